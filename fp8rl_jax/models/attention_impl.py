"""Which implementation of :func:`jax.nn.dot_product_attention` a cache-less attention forward uses.

Issue 19 asks for "attention through ``jax.nn.dot_product_attention`` (cuDNN flash on GPU, XLA on CPU)". JAX's
``implementation=None`` is XLA's attention on every backend (JAX 0.10: "defaults to XLA for now"), which
materialises the ``[B, H, S, T]`` scores: at the paper configs' 20480-token responses that is ~56 GB per sequence and
layer for Qwen3-8B (32 heads x 20992^2 x 4 bytes, by arithmetic), more than an H100 holds. ``"auto"`` (the default)
therefore asks for cuDNN's fused flash attention when it can run: a CUDA backend with cuDNN, bf16/fp16 queries, a
head dim that is a multiple of 8 and at most 128 (256 on Hopper and later; cuDNN's limit as JAX checks it), even
query and key lengths (cuDNN's rule for a bias in training; the boolean mask reaches cuDNN as a ``[B, 1, S, T]``
bias), and no KV cache (decode steps have one query row; their
scores are small and they stay on XLA). Everything else runs XLA's attention, with identical numerics to before;
on a GPU a cache-less forward of at least 4096 x 4096 that falls back is warned about once per reason.

What cuDNN still costs and changes (JAX 0.10.2): the boolean mask becomes a ``[B, 1, S, T]`` bias in the query
dtype, and the backward allocates a bias gradient of the same shape (~0.9 GB each per sequence and layer at
20992 tokens in bf16, by arithmetic); a padding query row (no visible key) attends almost uniformly (bf16) or to
all keys (fp16's -32768 bias), finite and masked downstream as with XLA; the softmax accumulates in another order
than XLA's, so trainer logprobs (cuDNN) and rollout logprobs (the engine's cached steps run XLA) differ by
rounding, part of the measured train-inference mismatch. cuDNN needs q, k and v sharded alike: with a ``tensor``
mesh axis that does not divide the KV heads (which are then replicated) the trainer uses XLA
(:class:`fp8rl_jax.trainer.loop.RLTrainer`). The choice follows ``jax.default_backend()``: a computation pinned to
the CPU on a GPU host should set ``"xla"``.

Source: JAX ``jax.nn.dot_product_attention`` (``implementation="cudnn"`` and its checks in
``jax._src.cudnn.fused_attention_stablehlo.check_is_flash_attention``).
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp

#: the settings an attention module accepts (``"xla"`` and ``None`` are the same)
ATTENTION_IMPLS = ("auto", "xla", "cudnn")


@functools.lru_cache(maxsize=None)
def cudnn_attention_available() -> bool:
    """True when the default backend is a CUDA GPU and JAX finds cuDNN (what ``implementation="cudnn"`` needs)."""
    try:
        if jax.default_backend() != "gpu" or "cuda" not in jax.devices()[0].client.platform_version.lower():
            return False
        from jax._src.cudnn.fused_attention_stablehlo import check_cudnn_version

        return check_cudnn_version() >= 8900
    except Exception:  # no GPU plugin, no cuDNN, or a JAX without the private helper
        return False


@functools.lru_cache(maxsize=None)
def _max_head_dim() -> int:
    try:
        cc = tuple(int(x) for x in jax.devices()[0].compute_capability.split("."))
    except Exception:
        return 128
    return 256 if cc >= (9, 0) else 128


#: query x key length from which a GPU fallback to XLA's attention (materialised scores) is warned about
LARGE_SCORES = 4096 * 4096


def cudnn_attention_problem(dtype, head_dim: int, q_len: int, kv_len: int) -> str | None:
    """Why cuDNN flash attention cannot run this cache-less call (a sentence), or None when it can (module
    docstring)."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"cuDNN flash attention needs bfloat16 or float16 queries, got {jnp.dtype(dtype).name}"
    if head_dim % 8 or head_dim > _max_head_dim():
        return f"cuDNN needs a head dim that is a multiple of 8 and <= {_max_head_dim()}, got {head_dim}"
    if q_len % 2 or kv_len % 2:
        return f"cuDNN needs even query/key lengths with a mask, got {q_len} and {kv_len}"
    if not cudnn_attention_available():
        return f"no CUDA GPU with cuDNN (backend {jax.default_backend()})"
    return None


def resolve_attention_implementation(setting: str | None, dtype, head_dim: int, q_len: int, kv_len: int,
                                     has_cache: bool) -> str | None:
    """The ``implementation=`` argument for :func:`jax.nn.dot_product_attention`: ``"cudnn"`` or None (XLA).

    Args:
      setting: ``"auto"`` (cuDNN when :func:`cudnn_attention_problem` finds none), ``"xla"`` / None (always XLA)
        or ``"cudnn"`` (cuDNN, or an error saying why not). Steps with a KV cache always run XLA's attention
        (the engine's own FP8 decode kernels aside).
      dtype: query dtype. head_dim: per-head size. q_len, kv_len: ``S`` and ``T``. has_cache: a KV-cache step.

    Raises:
      ValueError: an unknown setting; ``"cudnn"`` where cuDNN cannot run it (names the reason).
    """
    if setting is None or setting == "xla":
        return None
    if setting not in ATTENTION_IMPLS:
        raise ValueError(f"attention_implementation must be one of {ATTENTION_IMPLS}, got {setting!r}")
    if has_cache:
        return None
    problem = cudnn_attention_problem(dtype, head_dim, q_len, kv_len)
    if setting == "cudnn":
        if problem:
            raise ValueError(f"attention_implementation='cudnn' cannot run here: {problem}")
        return "cudnn"
    if problem and q_len * kv_len >= LARGE_SCORES and cudnn_attention_available():
        _warn_fallback(problem, q_len, kv_len)
    return None if problem else "cudnn"


@functools.lru_cache(maxsize=None)
def _warn_fallback(problem: str, q_len: int, kv_len: int) -> None:
    warnings.warn(f"attention falls back to XLA's implementation, which materialises [B, H, {q_len}, {kv_len}] "
                  f"scores: {problem}", stacklevel=3)
