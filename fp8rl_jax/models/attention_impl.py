"""Which implementation of :func:`jax.nn.dot_product_attention` a cache-less attention forward uses.

Issue 19 asks for "attention through ``jax.nn.dot_product_attention`` (cuDNN flash on GPU, XLA on CPU)". JAX's
``implementation=None`` is XLA's attention on every backend (JAX 0.10: "defaults to XLA for now"), which
materialises the ``[B, H, S, T]`` scores: at the paper configs' 20480-token responses that is ~56 GB per sequence and
layer for Qwen3-8B (32 heads x 20992^2 x 4 bytes, by arithmetic), more than an H100 holds. ``"auto"`` (the default)
therefore asks for cuDNN's fused flash attention when it can run: a CUDA backend with cuDNN, bf16/fp16 queries, a
head dim that is a multiple of 8 and at most 128 (256 on Hopper and later; cuDNN's limit as JAX checks it), even
query and key lengths, and no KV cache (decode steps have one query row; their
scores are small and they stay on XLA). Everything else runs XLA's attention, with identical numerics to before;
on a GPU a cache-less forward of at least 4096 x 4096 that falls back is warned about once per reason.

How cuDNN is called (issue 36): a left-padded batch never reaches cuDNN as a boolean mask. JAX turns a mask into a
``-2**41`` bias (bf16), which gives every left-pad query row a hugely negative logsumexp, and cuDNN's sm90 backward
is wrong there: on an H200 (jax 0.11.2, main at 3d93a32) the forward matched float64 while the gradients were 3.1x
off in relative norm on the *valid* rows. :func:`left_padded_attention` instead rotates each row so its real tokens
come first (right padding, which cuDNN's own ``query_seq_lengths`` / ``key_value_seq_lengths`` padding mask
supports), runs ``is_causal=True`` with no bias and no mask (so no ``[B, 1, S, T]`` bias or bias gradient is
allocated either), and rotates back. A query row with no visible key outputs 0 on every path
(:func:`zero_rows_without_keys`); the float64 reference (:func:`attention_reference_f64`) follows the same rule
instead of producing NaN. The ``cudnn_attention`` self-test (:func:`check_attention_kernel`) checks forward *and*
gradients at the trainer's layouts (left pads, a row that is all padding, GQA, bf16) before "auto" uses cuDNN on a
GPU. The softmax accumulates in another order than XLA's, so trainer logprobs (cuDNN) and rollout logprobs (the
engine's cached steps run XLA or the FP8-KV kernel) differ by rounding, part of the measured train-inference
mismatch. cuDNN needs q, k and v sharded alike: with a ``tensor`` mesh axis that does not divide the KV heads (which
are then replicated) the trainer uses XLA (:class:`fp8rl_jax.trainer.loop.RLTrainer`). The choice is made per computation, by the platform it is lowered for
(:func:`fp8rl_jax.kernels.registry.choose`, family ``cudnn_attention``): ``"auto"`` stages cuDNN for CUDA and XLA's
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

from fp8rl_jax.kernels.registry import KernelMismatch, choose, cuda_device, register_selftest

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


def left_pad_lengths(kv_mask: jax.Array) -> jax.Array:
    """Real tokens per row of a left-padded mask: int32 ``[B]`` = ``kv_mask.sum(-1)``.

    Args:
      kv_mask: bool ``[B, S]``, each row ``p`` False slots then ``S - p`` True ones (left padding, the layout of
        :func:`fp8rl_jax.models.decoder.left_pad` and of every trainer batch: left-padded prompt + response).
    """
    return jnp.sum(kv_mask.astype(jnp.int32), axis=-1)


def _shift_rows(x: jax.Array, shift: jax.Array) -> jax.Array:
    """``out[b, i] = x[b, (i + shift[b]) % S]`` for ``x [B, S, ...]``, ``shift`` int32 ``[B]`` (a per-row rotation:
    a permutation, so its transpose is the inverse rotation and gradients pass exactly)."""
    s = x.shape[1]
    idx = (jnp.arange(s, dtype=jnp.int32)[None, :] + shift[:, None]) % s
    return jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)


def left_padded_attention(q: jax.Array, k: jax.Array, v: jax.Array, kv_mask: jax.Array, *,
                          implementation: str | None = "cudnn", constrain=None) -> jax.Array:
    """Causal self-attention over left-padded rows through the layout cuDNN supports: rows right-aligned.

    Why: JAX's cuDNN path takes a boolean mask only as an additive ``-2**41`` bias (bf16;
    ``jax._src.cudnn.fused_attention_stablehlo.combine_bias_and_mask``), which leaves every left-pad query row with
    no visible key and a hugely negative logsumexp; cuDNN's sm90 backward gives wrong dQ/dK/dV there (measured on an
    H200 at 3d93a32: gradients 3.1x off in relative norm on the valid rows), and it also allocates a ``[B, 1, S, S]``
    bias and its gradient. cuDNN's own padding mask (``query_seq_lengths`` / ``key_value_seq_lengths``,
    ``MaskType.PADDING_CAUSAL``) handles *right* padding only. So each row is rotated left by its pad count ``p``
    (its ``S - p`` real tokens move to slots ``0..S-p-1``, still in order), attended with sequence lengths
    ``S - p`` and ``is_causal=True`` (no bias, no mask), and rotated back. Causality among the real tokens is
    unchanged by the rotation; pad keys fall beyond the length and are never seen.

    Rows with no real token (``p = S``) get a length of 1 (cuDNN is not asked to run an empty sequence) and, like
    every query row without a visible key, output 0 (:func:`zero_rows_without_keys`, applied here): the project's
    definition for a fully masked query row on every path, whose gradient is then 0 as well.

    Args:
      q: ``[B, S, H, D]``; k, v: ``[B, S, H_kv, D]`` (GQA: ``H % H_kv == 0``), bf16/fp16 for cuDNN.
      kv_mask: bool ``[B, S]``, left-padded (see :func:`left_pad_lengths`); a mask with holes is not this layout
        and gives wrong results (the trainer and :func:`fp8rl_jax.models.decoder.left_pad` only make suffixes).
      implementation: ``jax.nn.dot_product_attention``'s (``"cudnn"``; ``None``/``"xla"`` runs the same layout
        through XLA, which is how the CPU tests check the rotation).
      constrain: optional ``f(x) -> x`` applied to the rotated q, k, v (a sharding constraint).

    Returns:
      ``[B, S, H, D]`` in q's dtype: row ``b``, slot ``i`` attends causally over the real slots ``<= i``.

    Source: JAX ``jax.nn.dot_product_attention`` (``query_seq_lengths``, ``key_value_seq_lengths``, ``is_causal``)
    and cuDNN's padding-causal mask (right padding).
    """
    s = q.shape[1]
    lengths = left_pad_lengths(kv_mask)
    pads = s - lengths
    qr, kr, vr = (_shift_rows(t, pads) for t in (q, k, v))
    if constrain is not None:
        qr, kr, vr = constrain(qr), constrain(kr), constrain(vr)
    seq = jnp.maximum(lengths, 1).astype(jnp.int32)
    out = jax.nn.dot_product_attention(qr, kr, vr, is_causal=True, query_seq_lengths=seq,
                                       key_value_seq_lengths=seq, implementation=implementation)
    out = _shift_rows(out, (s - pads) % s)  # rotate back
    return jnp.where(kv_mask[:, :, None, None], out, jnp.zeros((), out.dtype))


def rows_with_keys(kv_mask: jax.Array, q_slots: jax.Array) -> jax.Array:
    """bool ``[B, S]``: whether query ``(b, i)`` sees any key, i.e. some ``t <= q_slots[b, i]`` with ``kv_mask[b, t]``
    (the visibility rule of :meth:`fp8rl_jax.models.decoder.Attention.forward`), from the first real slot of each
    row: ``O(B (S + T))``, no ``[B, S, T]`` mask.

    Args:
      kv_mask: bool ``[B, T]``; q_slots: int32 ``[B, S]`` (each query's own slot).
    """
    first = jnp.argmax(kv_mask, axis=-1).astype(q_slots.dtype)  # first True slot (0 for a row without one)
    return jnp.any(kv_mask, axis=-1)[:, None] & (q_slots >= first[:, None])


def zero_rows_without_keys(out: jax.Array, has_key: jax.Array) -> jax.Array:
    """Set the output of every query row that sees no key to 0 (the definition on every attention path).

    A fully masked query row (a left-pad slot: no real key at or before it) has no softmax: XLA's attention would
    average all slots uniformly, cuDNN's bias path nearly so, the float64 formula gives 0/0. The project defines its
    output as 0, as flash attention with a padding mask (cuDNN, vLLM) does; its gradient into q, k and v is then 0,
    so such rows can never leak into the real rows' gradients.

    Args:
      out: ``[B, S, ...]`` attention output.
      has_key: bool ``[B, S]``, whether query ``(b, i)`` sees at least one key.

    Returns:
      ``out`` with those rows zeroed (same shape and dtype).
    """
    return jnp.where(has_key.reshape(has_key.shape + (1,) * (out.ndim - 2)), out, jnp.zeros((), out.dtype))


def attention_reference_f64(q, k, v, allowed, cotangent=None):
    """Float64 numpy attention (GQA) with the project's fully-masked-row rule, and optionally its gradients.

    ``out[b, i] = softmax_t(q[b, i] . k[b, t] / sqrt(D), t allowed) @ v``; a row with no allowed key gives 0 (no
    NaN: its softmax is never formed). With ``cotangent`` (``dO``, the shape of ``out``), also the vector-Jacobian
    product of ``sum(out * dO)``: ``dV = P^T dO``, ``dP = dO V^T``, ``dS = P * (dP - rowsum(P * dP))``,
    ``dQ = dS K / sqrt(D)``, ``dK = dS^T Q / sqrt(D)`` (the softmax backward; rows without a key contribute 0),
    summed over each KV head's query group.

    Args:
      q: ``[B, S, H, D]``; k, v: ``[B, T, H_kv, D]`` (any float dtype; computed in float64).
      allowed: bool ``[B, S, T]``.
      cotangent: optional ``[B, S, H, D]``.

    Returns:
      ``out`` float64 ``[B, S, H, D]``, or ``(out, (dq, dk, dv))`` with a cotangent.
    """
    import numpy as np

    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    allowed = np.asarray(allowed, bool)
    b, s, h, d = q.shape
    g = h // k.shape[2]
    kk, vv = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    sc = np.einsum("bshd,bthd->bhst", q, kk) / np.sqrt(d)
    al = allowed[:, None]
    has = al.any(-1, keepdims=True)  # [B, 1, S, 1]
    sc = np.where(al, sc, -np.inf)
    mx = np.where(has, sc.max(-1, keepdims=True), 0.0)
    p = np.where(al, np.exp(np.where(al, sc - mx, 0.0)), 0.0)
    p = p / np.where(has, p.sum(-1, keepdims=True), 1.0)
    out = np.einsum("bhst,bthd->bshd", p, vv)
    if cotangent is None:
        return out
    do = np.asarray(cotangent, np.float64)
    dvv = np.einsum("bhst,bshd->bthd", p, do)
    dp = np.einsum("bshd,bthd->bhst", do, vv)
    ds = p * (dp - (p * dp).sum(-1, keepdims=True))
    dq = np.einsum("bhst,bthd->bshd", ds, kk) / np.sqrt(d)
    dkk = np.einsum("bhst,bshd->bthd", ds, q) / np.sqrt(d)
    group = lambda a: a.reshape(b, a.shape[1], -1, g, d).sum(3)  # noqa: E731  (sum each KV head's queries)
    return out, (dq, group(dkk), group(dvv))


#: the layouts the ``cudnn_attention`` self-test checks: ``(pads per row, S)``; row 0 unpadded, rows with short and
#: long left pads, and one row that is all padding (a batch filler)
SELFTEST_PADS = (0, 5, 37, 64)


def check_attention_kernel(fn, *, dtype=jnp.bfloat16, fwd_rtol: float = 3e-2, grad_rtol: float = 4e-2) -> None:
    """Check a left-padded causal attention ``fn(q, k, v, kv_mask) -> out`` (forward and gradients) against
    :func:`attention_reference_f64`, at the layouts the trainer produces.

    The case: B = 4 rows of S = 64 with :data:`SELFTEST_PADS` left pads (no pad, 5, 37, and a row that is all
    padding), GQA (4 query heads over 2 KV heads), head dim 64, ``dtype`` inputs. The loss is ``sum(out * dO)`` with a
    random ``dO`` on every row, pad rows included (so a kernel whose pad rows leak into the real rows' gradients
    fails). Relative Frobenius errors: the output over all rows (pad rows must be 0) within ``fwd_rtol``, and
    each of dq, dk, dv within ``grad_rtol`` (bf16 inputs, outputs and probabilities: ~2^-8 per element).

    Raises:
      KernelMismatch: an error over its bound, or a non-finite value (names the tensor and the size).
    """
    import numpy as np

    rng = np.random.default_rng(0)
    b, s, h, hkv, d = len(SELFTEST_PADS), 64, 4, 2, 64
    q, k, v = (rng.standard_normal((b, s, n, d)).astype(np.float32) for n in (h, hkv, hkv))
    kv_mask = np.arange(s)[None, :] >= np.asarray(SELFTEST_PADS)[:, None]
    allowed = kv_mask[:, None, :] & (np.arange(s)[None, None, :] <= np.arange(s)[None, :, None])
    do = rng.standard_normal((b, s, h, d)).astype(np.float32)
    args = [jnp.asarray(a, dtype) for a in (q, k, v)]
    out, vjp = jax.vjp(lambda *a: fn(*a, jnp.asarray(kv_mask)), *args)
    grads = vjp(jnp.asarray(do, out.dtype))
    q64, k64, v64, do64 = (np.asarray(jnp.asarray(a, dtype), np.float64) for a in (q, k, v, do))
    ref, (dq, dk, dv) = attention_reference_f64(q64, k64, v64, allowed, do64)
    for name, got, want, tol in (("output", out, ref, fwd_rtol), ("dq", grads[0], dq, grad_rtol),
                                 ("dk", grads[1], dk, grad_rtol), ("dv", grads[2], dv, grad_rtol)):
        got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
        if not np.all(np.isfinite(got)):
            raise KernelMismatch(f"attention {name}: {int(np.sum(~np.isfinite(got)))} non-finite values")
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        if not err < tol:
            raise KernelMismatch(f"attention {name}: relative error {err:.3g} against the float64 formula "
                                 f"(limit {tol:g}; left pads {SELFTEST_PADS}, GQA 4/2 heads, {jnp.dtype(dtype).name})")


def _selftest_cudnn_attention() -> None:
    """Self-test of the ``cudnn_attention`` family on the default (CUDA) device: the trainer's cuDNN call
    (:func:`left_padded_attention`), forward and gradients, bf16, through :func:`check_attention_kernel`.

    Raises:
      KernelMismatch: as :func:`check_attention_kernel`.
    """
    check_attention_kernel(lambda q, k, v, m: left_padded_attention(q, k, v, m, implementation="cudnn"))


register_selftest("cudnn_attention", _selftest_cudnn_attention)
