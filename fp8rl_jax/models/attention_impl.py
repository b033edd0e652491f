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
(:class:`fp8rl_jax.trainer.loop.RLTrainer`). The choice is made per computation, by the platform it is lowered for
(:func:`fp8rl_jax.fp8.kernels.choose`, family ``cudnn_attention``): ``"auto"`` stages cuDNN for CUDA and XLA's
attention for every other platform, so a computation pinned to the CPU on a GPU host runs XLA's, and a cuDNN that
fails its one-time self-test on the GPU (or ``FP8RL_KERNELS=xla``) falls back to XLA.

Source: JAX ``jax.nn.dot_product_attention`` (``implementation="cudnn"`` and its checks in
``jax._src.cudnn.fused_attention_stablehlo.check_is_flash_attention``).
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp

from fp8rl_jax.fp8.kernels import KernelMismatch, choose, cuda_device, register_selftest

#: the settings an attention module accepts (``"xla"`` and ``None`` are the same)
ATTENTION_IMPLS = ("auto", "xla", "cudnn")


@functools.lru_cache(maxsize=None)
def cudnn_attention_available() -> bool:
    """True when this process has a CUDA device and JAX finds cuDNN >= 8.9 (what ``implementation="cudnn"`` needs to
    run; compiling for CUDA needs neither)."""
    return cuda_device() is not None and cudnn_loadable()


@functools.lru_cache(maxsize=None)
def cudnn_loadable() -> bool:
    """True when JAX finds cuDNN >= 8.9 in this process (its CUDA plugin and cuDNN are installed), device or not.

    ``jax.nn.dot_product_attention(implementation="cudnn")`` checks this when it is traced, so without it the cuDNN
    path cannot even be staged for CUDA: every platform then gets XLA's attention (a CPU-only install).
    """
    try:
        from jax._src.cudnn.fused_attention_stablehlo import check_cudnn_version

        return check_cudnn_version() >= 8900
    except Exception:  # no CUDA plugin or no cuDNN
        return False


def _abstract_gpu_target() -> bool:
    """An abstract GPU mesh is in context (``jax.sharding.use_abstract_mesh``: a deviceless compile for a GPU)."""
    dev = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    return dev is not None and getattr(dev, "platform", None) in ("gpu", "cuda")


@functools.lru_cache(maxsize=None)
def _max_head_dim() -> int:
    """cuDNN's head-dim limit: 256 from Hopper on, 128 before; Hopper when no CUDA device says otherwise (the target
    of a deviceless compile)."""
    dev = cuda_device()
    try:
        cc = tuple(int(x) for x in dev.compute_capability.split(".")) if dev is not None else (9, 0)
    except Exception:
        return 128
    return 256 if cc >= (9, 0) else 128


#: query x key length from which a GPU fallback to XLA's attention (materialised scores) is warned about
LARGE_SCORES = 4096 * 4096


def cudnn_attention_problem(dtype, head_dim: int, q_len: int, kv_len: int) -> str | None:
    """Why cuDNN flash attention cannot run this cache-less call on a CUDA GPU (a sentence), or None when it can
    (module docstring). Only the call's own properties count: where it runs is decided when it is lowered."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"cuDNN flash attention needs bfloat16 or float16 queries, got {jnp.dtype(dtype).name}"
    if head_dim % 8 or head_dim > _max_head_dim():
        return f"cuDNN needs a head dim that is a multiple of 8 and <= {_max_head_dim()}, got {head_dim}"
    if q_len % 2 or kv_len % 2:
        return f"cuDNN needs even query/key lengths with a mask, got {q_len} and {kv_len}"
    return None


def resolve_attention_implementation(setting: str | None, dtype, head_dim: int, q_len: int, kv_len: int,
                                     has_cache: bool) -> str | None:
    """``"cudnn"`` when this call may run cuDNN flash attention where it is lowered for CUDA, None for XLA's attention
    on every platform.

    Args:
      setting: ``"auto"`` (cuDNN when :func:`cudnn_attention_problem` finds none), ``"xla"`` / None (always XLA)
        or ``"cudnn"`` (cuDNN, or an error saying why not). Steps with a KV cache always run XLA's attention
        (the engine's own FP8 decode kernels aside).
      dtype: query dtype. head_dim: per-head size. q_len, kv_len: ``S`` and ``T``. has_cache: a KV-cache step.

    Raises:
      ValueError: an unknown setting; ``"cudnn"`` for a call cuDNN cannot run, or in a process with neither a CUDA
        device nor an abstract GPU mesh in context (names the reason).
    """
    if setting is None or setting == "xla":
        return None
    if setting not in ATTENTION_IMPLS:
        raise ValueError(f"attention_implementation must be one of {ATTENTION_IMPLS}, got {setting!r}")
    if has_cache:
        return None
    problem = cudnn_attention_problem(dtype, head_dim, q_len, kv_len)
    if setting == "cudnn":
        if problem is None and not (cudnn_attention_available() or (_abstract_gpu_target() and cudnn_loadable())):
            problem = ("no CUDA GPU with cuDNN in this process (nor cuDNN and an abstract GPU mesh to compile for)")
        if problem:
            raise ValueError(f"attention_implementation='cudnn' cannot run here: {problem}")
        return "cudnn"
    if problem and q_len * kv_len >= LARGE_SCORES and cudnn_attention_available():
        _warn_fallback(problem, q_len, kv_len)
    return None if problem else "cudnn"


def dot_product_attention_dispatch(setting: str | None, q, k, v, has_cache: bool, attention, xla=None):
    """Run attention as ``setting`` resolves for this call (:func:`resolve_attention_implementation`).

    Args:
      setting: the module's ``attention_implementation``.
      q: ``[B, S, H, D]``; k, v: ``[B, T, H_kv, D]``.
      has_cache: a KV-cache step.
      attention: ``attention(implementation)`` -> a callable ``(q, k, v) -> out`` (``jax.nn.dot_product_attention``
        with that ``implementation``).
      xla: the XLA path (default ``attention(None)``).

    Returns:
      the chosen callable's output: cuDNN's where the program is lowered for CUDA (``"auto"``: unless the
      ``cudnn_attention`` self-test failed, ``FP8RL_KERNELS=xla``, or this install has no cuDNN:
      :func:`cudnn_loadable`), XLA's elsewhere.

    Raises:
      ValueError: as :func:`resolve_attention_implementation`.
    """
    xla = xla or attention(None)
    impl = resolve_attention_implementation(setting, q.dtype, q.shape[-1], q.shape[1], k.shape[1], has_cache)
    if impl is None:
        return xla(q, k, v)
    if setting == "cudnn":
        return attention("cudnn")(q, k, v)
    if not cudnn_loadable():  # no cuDNN in this install: the cuDNN path cannot be traced, XLA's everywhere
        return xla(q, k, v)
    return choose("cudnn_attention", q, k, v, kernel=attention("cudnn"), xla=xla)


@functools.lru_cache(maxsize=None)
def _warn_fallback(problem: str, q_len: int, kv_len: int) -> None:
    warnings.warn(f"attention falls back to XLA's implementation, which materialises [B, H, {q_len}, {kv_len}] "
                  f"scores: {problem}", stacklevel=3)


def _selftest_cudnn_attention() -> None:
    """Self-test of the ``cudnn_attention`` family on the default (CUDA) device: a causal, left-padded bf16 call
    through cuDNN against the float64 numpy formula (bf16 tolerance).

    Raises:
      KernelMismatch: the relative error exceeds 3e-2 (bf16 inputs and probabilities).
    """
    import numpy as np

    rng = np.random.default_rng(0)
    b, s, h, hkv, d = 2, 64, 4, 2, 64
    q, k, v = (rng.standard_normal((b, s, n, d)).astype(np.float32) for n in (h, hkv, hkv))
    mask = np.tril(np.ones((s, s), bool))[None, None] & (np.arange(s) >= 5)[None, None, None, :]
    mask = np.broadcast_to(mask, (b, 1, s, s))
    out = jax.nn.dot_product_attention(*(jnp.asarray(a, jnp.bfloat16) for a in (q, k, v)), mask=jnp.asarray(mask),
                                       implementation="cudnn")
    q64, k64, v64 = (np.asarray(jnp.asarray(a, jnp.bfloat16), np.float64) for a in (q, k, v))
    g = h // hkv
    k64, v64 = np.repeat(k64, g, axis=2), np.repeat(v64, g, axis=2)
    sc = np.einsum("bshd,bthd->bhst", q64, k64) / np.sqrt(d)
    sc = np.where(mask, sc, -np.inf)
    p = np.exp(sc - sc.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ref = np.einsum("bhst,bthd->bshd", p, v64)
    rows = np.arange(s) >= 5  # query rows with a visible key
    err = np.linalg.norm(np.asarray(out, np.float64)[:, rows] - ref[:, rows]) / np.linalg.norm(ref[:, rows])
    if not err < 3e-2:
        raise KernelMismatch(f"cuDNN attention relative error {err:.3g} against the float64 formula (limit 3e-2)")


register_selftest("cudnn_attention", _selftest_cudnn_attention)
