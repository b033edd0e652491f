"""Attention (``jax.nn.dot_product_attention`` path) against an independent float64 numpy formula.

The reference recomputes the whole attention block in float64 from the module's own parameters: q/k/v
projections (+ Qwen2 bias), Qwen3 per-head RMSNorm, rotate-half RoPE, GQA scores ``q.k / sqrt(d)`` with key slot
``t`` visible to query slot ``i`` iff ``kv_mask[t] and t <= i``, float64 softmax, ``o_proj``. Cases: left padding
without a cache, and a cache filled by a prefill then extended by a chunk at a cache offset (bf16/f32 cache and an
e4m3 cache whose reference dequantizes with ``ml_dtypes``), in float32 and bfloat16 (float16 without a cache: it
keeps the einsum path, see ``Attention.forward``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from fp8rl_jax.kernels.registry import selftest_passed as kernels_selftest_passed
from fp8rl_jax.gpu_target import lowering_for_h100
from flax import nnx

from fp8rl_jax.models.config import ModelConfig
from fp8rl_jax.models.decoder import Attention, positions_from_mask, rope_inv_freq


def _cfg(family: str) -> ModelConfig:
    return ModelConfig(model_type=family, vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=6, num_key_value_heads=2, head_dim=16, rope_theta=10000.0,
                       attention_bias=family == "qwen2", qk_norm=family == "qwen3")


def _attn(cfg: ModelConfig, dtype, seed: int = 0) -> Attention:
    """An Attention whose weights are large enough for peaked (non-uniform) softmax rows."""
    m = Attention(cfg, linear_precision="dense", param_dtype=dtype, dtype=dtype, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    for path, var in nnx.to_flat_state(nnx.state(m, nnx.Param)):
        shape = var[...].shape
        val = rng.normal(0, 0.35, shape) if path[-1] == "weight" and len(shape) == 2 else 1 + rng.normal(0, 0.2, shape)
        if path[-1] == "bias":
            val = rng.normal(0, 0.3, shape)
        var[...] = jnp.asarray(val, dtype)
    return m


def _p(m: Attention) -> dict:
    """The module's parameters as float64 numpy, keyed by dotted path."""
    return {".".join(map(str, p)): np.asarray(v[...].astype(jnp.float32), np.float64)
            for p, v in nnx.to_flat_state(nnx.state(m, nnx.Param))}


def _rms(x, w, eps):
    return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def _rope(x, pos, theta):
    d = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    f = pos[..., None].astype(np.float64) * inv
    emb = np.concatenate([f, f], -1)[:, :, None, :]
    rot = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * np.cos(emb) + rot * np.sin(emb)


def _qkv_ref(p, cfg, x, pos):
    """float64 q [B,S,H,D], k, v [B,S,Hkv,D] after bias, QK-norm and RoPE."""
    b, s, _ = x.shape
    h, hk, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim

    def lin(name, n):
        y = x @ p[f"{name}.weight"].T
        return (y + p[f"{name}.bias"] if f"{name}.bias" in p else y).reshape(b, s, n, d)

    q, k, v = lin("q_proj", h), lin("k_proj", hk), lin("v_proj", hk)
    if cfg.qk_norm:
        q, k = _rms(q, p["q_norm.weight"], cfg.rms_norm_eps), _rms(k, p["k_norm.weight"], cfg.rms_norm_eps)
    return _rope(q, pos, cfg.rope_theta), _rope(k, pos, cfg.rope_theta), v


def _attend_ref(p, cfg, q, k, v, kv_mask, q_slots):
    """float64 GQA attention: ``q [B,S,H,D]``, ``k, v [B,T,Hkv,D]``, ``kv_mask [B,T]``, ``q_slots [B,S]``."""
    b, s, h, d = q.shape
    t, g = k.shape[1], h // k.shape[2]
    out = np.zeros((b, s, h, d))
    for bi in range(b):
        for hi in range(h):
            sc = q[bi, :, hi] @ k[bi, :, hi // g].T / math.sqrt(d)            # [S, T]
            allowed = kv_mask[bi][None, :] & (np.arange(t)[None, :] <= q_slots[bi][:, None])
            has = allowed.any(-1, keepdims=True)  # a fully masked row outputs 0 (the project's rule)
            sc = np.where(allowed, sc, -np.inf)
            pr = np.where(allowed, np.exp(np.where(allowed, sc - np.where(has, sc.max(-1, keepdims=True), 0), 0)), 0)
            out[bi, :, hi] = (pr / np.where(has, pr.sum(-1, keepdims=True), 1)) @ v[bi, :, hi // g]
    return out.reshape(b, s, h * d) @ p["o_proj.weight"].T


def _inputs(cfg, b, s, pads, dtype, seed=1):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(0, 1, (b, s, cfg.hidden_size)), dtype)
    mask = np.ones((b, s), bool)
    for i, n in enumerate(pads):
        mask[i, :n] = False
    return x, mask


TOL = {jnp.float32: 2e-5, jnp.bfloat16: 4e-2, jnp.float16: 5e-3}


def _close(got, ref, rows, dtype):
    """Compare the real query rows (a fully masked padding row outputs 0: test_fully_masked_row_outputs_zero...)."""
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)[rows]
    ref = ref[rows]
    err = np.max(np.abs(got - ref)) / np.max(np.abs(ref))
    assert err < TOL[dtype], f"max relative error {err:.3g} >= {TOL[dtype]}"


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=["f32", "bf16", "f16"])
def test_cacheless_left_padded_matches_float64(family, dtype):
    cfg = _cfg(family)
    m = _attn(cfg, dtype)
    b, s = 3, 9
    x, mask = _inputs(cfg, b, s, pads=(0, 3, 6), dtype=dtype)
    pos = np.asarray(positions_from_mask(jnp.asarray(mask)))
    q_slots = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    out, kv = jax.jit(lambda x: m(x, jnp.asarray(pos), rope_inv_freq(cfg), jnp.asarray(mask), q_slots))(x)
    assert kv is None and out.dtype == dtype and out.shape == (b, s, cfg.hidden_size)
    p = _p(m)
    q, k, v = _qkv_ref(p, cfg, np.asarray(x.astype(jnp.float32), np.float64), pos)
    ref = _attend_ref(p, cfg, q, k, v, mask, np.asarray(q_slots))
    _close(out, ref, mask, dtype)


def _e4m3_roundtrip(x, scale):
    return np.clip(x / scale, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * scale


@pytest.mark.parametrize("cache", ["model", "e4m3"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_cache_offset_matches_float64(cache, dtype):
    """Prefill P left-padded tokens into a T_max cache, then a C-token chunk at cache_index=P: the chunk's outputs
    equal causal attention over the whole left-padded sequence (slots past P + C hold zeros and are masked)."""
    cfg = _cfg("qwen3")
    m = _attn(cfg, dtype, seed=2)
    b, p_len, c_len, t_max = 2, 6, 3, 12
    x, mask = _inputs(cfg, b, p_len + c_len, pads=(0, 4), dtype=dtype, seed=3)
    pos = np.asarray(positions_from_mask(jnp.asarray(mask)))
    kv_mask = np.zeros((b, t_max), bool)
    kv_mask[:, :p_len + c_len] = mask
    hk, d = cfg.num_key_value_heads, cfg.head_dim
    if cache == "e4m3":
        ks, vs = jnp.float32(0.02), jnp.float32(0.015)
        zeros = jnp.zeros((b, t_max, hk, d), ml_dtypes.float8_e4m3fn)
        ckv = (zeros, zeros, ks, vs)
    else:
        zeros = jnp.zeros((b, t_max, hk, d), dtype)
        ckv = (zeros, zeros)
    inv = rope_inv_freq(cfg)

    @jax.jit
    def step(xc, posc, ckv, idx):
        sc = xc.shape[1]
        q_slots = jnp.broadcast_to(idx + jnp.arange(sc, dtype=jnp.int32), (b, sc))
        return m(xc, posc, inv, jnp.asarray(kv_mask), q_slots, ckv, idx)

    _, (ck, cv) = step(x[:, :p_len], jnp.asarray(pos[:, :p_len]), ckv, jnp.int32(0))
    out, _ = step(x[:, p_len:], jnp.asarray(pos[:, p_len:]), (ck, cv) + ckv[2:], jnp.int32(p_len))
    pr = _p(m)
    q, k, v = _qkv_ref(pr, cfg, np.asarray(x.astype(jnp.float32), np.float64), pos)
    if cache == "e4m3":
        # the cache stores e4m3(k / k_scale) of the model-dtype k; attention reads it back times the scale
        kd = np.asarray(jnp.asarray(k, dtype).astype(jnp.float32), np.float64)
        vd = np.asarray(jnp.asarray(v, dtype).astype(jnp.float32), np.float64)
        k, v = _e4m3_roundtrip(kd, float(ks)), _e4m3_roundtrip(vd, float(vs))
    pad = t_max - (p_len + c_len)
    k = np.concatenate([k, np.zeros((b, pad, hk, d))], 1)
    v = np.concatenate([v, np.zeros((b, pad, hk, d))], 1)
    q_slots = np.broadcast_to(np.arange(p_len, p_len + c_len), (b, c_len))
    ref = _attend_ref(pr, cfg, q[:, p_len:], k, v, kv_mask, q_slots)
    _close(out, ref, mask[:, p_len:], dtype)


def test_fully_masked_row_outputs_zero_and_passes_no_gradient():
    """Issue 36 (4): a padding query row (no visible key) outputs 0 on every path (it averaged V uniformly before)
    and its cotangent reaches no real row: the gradient of a loss on the pad rows alone is exactly 0. The float64
    reference of the self-test gives 0 for such a row without a NaN or a numpy warning (it warned and made NaN)."""
    import warnings

    from fp8rl_jax.models import attention_impl as ai

    cfg = _cfg("llama")
    m = _attn(cfg, jnp.float32)
    b, s = 2, 5
    x, mask = _inputs(cfg, b, s, pads=(2, 0), dtype=jnp.float32)
    pos = positions_from_mask(jnp.asarray(mask))
    q_slots = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    args = (pos, rope_inv_freq(cfg), jnp.asarray(mask), q_slots)
    out, _ = m(x, *args)
    assert np.all(np.asarray(out)[~mask] == 0) and np.all(np.abs(np.asarray(out)[mask]) > 0)
    g = jax.grad(lambda x: jnp.sum(m(x, *args)[0] * jnp.asarray(~mask, jnp.float32)[..., None]))(x)
    assert np.all(np.asarray(g) == 0)
    rng = np.random.default_rng(0)
    q, k, v = rng.normal(size=(1, 4, 2, 8)), rng.normal(size=(1, 4, 1, 8)), rng.normal(size=(1, 4, 1, 8))
    allowed = np.tril(np.ones((4, 4), bool))[None] & (np.arange(4) >= 2)[None, None, :]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ref, grads = ai.attention_reference_f64(q, k, v, allowed, rng.normal(size=q.shape))
    assert np.all(np.isfinite(ref)) and np.all(ref[0, :2] == 0) and np.all(np.abs(ref[0, 2:]) > 0)
    assert all(np.all(np.isfinite(gr)) for gr in grads) and np.all(grads[0][0, :2] == 0)


def _rolled_xla(q, k, v, kv_mask):
    from fp8rl_jax.models.attention_impl import left_padded_attention

    return left_padded_attention(q, k, v, kv_mask, implementation=None)


def _leaky_gradient_attention(q, k, v, kv_mask):
    """A kernel with the right forward (pad rows 0) whose backward lets the pad rows' cotangent reach the real keys:
    the class of error cuDNN's bias path showed on the H200."""
    from fp8rl_jax.models.attention_impl import zero_rows_without_keys

    s = q.shape[1]
    allowed = kv_mask[:, None, :] & (jnp.arange(s)[None, None, :] <= jnp.arange(s)[None, :, None])
    raw = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=allowed[:, None])  # noqa: E731

    @jax.custom_vjp
    def f(q, k, v):
        return zero_rows_without_keys(raw(q, k, v), allowed.any(-1))

    def fwd(q, k, v):
        return f(q, k, v), (q, k, v)

    def bwd(res, g):
        return jax.vjp(raw, *res)[1](g)  # pad rows' cotangent not zeroed

    f.defvjp(fwd, bwd)
    return f(q, k, v)


def test_cudnn_selftest_checks_gradients_at_the_trainer_layouts(monkeypatch):
    """Issue 36 (1): the ``cudnn_attention`` self-test checks the forward *and* dq, dk, dv against float64, at left
    pads, a row that is all padding, GQA, bf16. The trainer's cuDNN layout (rows rotated to right padding, seq
    lengths, causal) passes it when run through XLA on this CPU; a kernel with a right forward and a gradient that
    leaks the pad rows (what cuDNN's bias path did on the H200) fails it, through the registered self-test itself."""
    from fp8rl_jax.kernels.registry import KernelMismatch
    from fp8rl_jax.models import attention_impl as ai

    assert 0 in ai.SELFTEST_PADS and 64 in ai.SELFTEST_PADS and len(set(ai.SELFTEST_PADS)) >= 3
    ai.check_attention_kernel(_rolled_xla)
    with pytest.raises(KernelMismatch, match=r"attention d[qkv]: relative error"):
        ai.check_attention_kernel(_leaky_gradient_attention)
    calls = []

    def fake(q, k, v, kv_mask, *, implementation, constrain=None):
        calls.append(implementation)
        return _leaky_gradient_attention(q, k, v, kv_mask)

    monkeypatch.setattr(ai, "left_padded_attention", fake)
    with pytest.raises(KernelMismatch, match=r"attention d[qkv]"):
        ai._selftest_cudnn_attention()
    assert calls == ["cudnn"]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_left_padded_layout_matches_float64_forward_and_gradients(dtype):
    """The rotation to right padding (what cuDNN receives) run through XLA equals the float64 formula on every row
    and gives the float64 gradients, at several pad counts including a fully padded row and no padding."""
    from fp8rl_jax.models.attention_impl import attention_reference_f64

    rng = np.random.default_rng(3)
    b, s, h, hkv, d = 4, 12, 4, 2, 16
    pads = np.array([0, 3, 11, 12])
    kv_mask = np.arange(s)[None, :] >= pads[:, None]
    allowed = kv_mask[:, None, :] & np.tril(np.ones((s, s), bool))[None]
    q, k, v = (rng.normal(size=(b, s, n, d)) for n in (h, hkv, hkv))
    do = rng.normal(size=(b, s, h, d))
    args = [jnp.asarray(a, dtype) for a in (q, k, v)]
    out, vjp = jax.vjp(lambda *a: _rolled_xla(*a, jnp.asarray(kv_mask)), *args)
    grads = vjp(jnp.asarray(do, dtype))
    q64, k64, v64, do64 = (np.asarray(jnp.asarray(a, dtype).astype(jnp.float32), np.float64) for a in (q, k, v, do))
    ref, gref = attention_reference_f64(q64, k64, v64, allowed, do64)
    tol = 2e-5 if dtype == jnp.float32 else 3e-2
    for got, want in zip((out, *grads), (ref, *gref)):
        got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < tol
    assert np.all(np.asarray(out)[~kv_mask] == 0)


def test_attention_implementation_choice_and_named_errors(monkeypatch):
    """``"auto"`` stages cuDNN flash attention exactly where cuDNN can run the call (cache-less, bf16/fp16, head dim a
    multiple of 8 within the limit, even lengths) and XLA elsewhere; where it runs is decided when the program is
    lowered (cuDNN for CUDA, XLA for any other platform: test_cache_less_attention_lowers_to_cudnn_for_cuda_only).
    Bad settings and an impossible ``"cudnn"`` are refused by name. The GPU itself:
    test_cudnn_attention_on_gpu_matches_float64."""
    from fp8rl_jax.models import attention_impl as ai

    if not ai.cudnn_attention_available():  # this machine: "cudnn" forced is refused with the reason
        with pytest.raises(ValueError, match="no CUDA GPU with cuDNN"):
            ai.resolve_attention_implementation("cudnn", jnp.bfloat16, 128, 512, 512, False)
    monkeypatch.setattr(ai, "_max_head_dim", lambda: 128)
    pick = ai.resolve_attention_implementation
    assert pick("auto", jnp.bfloat16, 128, 512, 512, False) == "cudnn"
    assert pick("auto", jnp.float16, 64, 8, 8, False) == "cudnn"
    assert pick("auto", jnp.float32, 128, 512, 512, False) is None      # cuDNN flash: bf16/fp16 only
    assert pick("auto", jnp.bfloat16, 100, 512, 512, False) is None     # head dim not a multiple of 8
    assert pick("auto", jnp.bfloat16, 256, 512, 512, False) is None     # over the pre-Hopper limit
    assert pick("auto", jnp.bfloat16, 128, 511, 511, False) is None     # odd lengths with a mask
    assert pick("auto", jnp.bfloat16, 128, 1, 512, True) is None        # KV-cache steps stay on XLA
    assert pick("xla", jnp.bfloat16, 128, 512, 512, False) is None
    assert pick(None, jnp.bfloat16, 128, 2, 2, False) is None
    with pytest.raises(ValueError, match="multiple of 8"):
        pick("cudnn", jnp.bfloat16, 100, 512, 512, False)
    with pytest.raises(ValueError, match="attention_implementation must be one of"):
        pick("flash", jnp.bfloat16, 128, 512, 512, False)
    monkeypatch.setattr(ai, "cudnn_loadable", lambda: True)
    with lowering_for_h100():  # compiling for an abstract H100 with cuDNN installed: "cudnn" is allowed
        assert pick("cudnn", jnp.bfloat16, 128, 512, 512, False) == "cudnn"


@pytest.mark.parametrize("setting", ["auto", "xla"])
def test_cache_less_attention_lowers_to_cudnn_for_cuda_only(setting):
    """Issue 28 (1): one bf16 cache-less attention forward, lowered for CUDA and for the CPU in this CPU-only process:
    ``"auto"`` puts cuDNN's fused attention custom call in the CUDA program only (the CPU program is XLA's, so a
    CPU-placed computation on a GPU host works); ``"xla"`` never asks for cuDNN. Where this install has no cuDNN
    (the CPU venv: JAX's cuDNN attention cannot even be traced) every program is XLA's; the deviceless sm_90a
    compile (scripts/compile_h100.py, the CUDA venv) shows the cuDNN call in the compiled train step."""
    from fp8rl_jax.models.attention_impl import cudnn_loadable

    cfg = ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=256, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, rope_theta=10000.0, qk_norm=True)
    m = _attn(cfg, jnp.bfloat16)
    m.attention_implementation = setting
    b, s = 2, 64
    x, mask = _inputs(cfg, b, s, pads=(0, 5), dtype=jnp.bfloat16)
    pos = np.asarray(positions_from_mask(jnp.asarray(mask)))
    q_slots = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    args = (jnp.asarray(pos), rope_inv_freq(cfg), jnp.asarray(mask), q_slots)
    f = jax.jit(lambda x: m(x, *args)[0])
    cpu = f.trace(x).lower(lowering_platforms=("cpu",)).as_text()
    with lowering_for_h100():
        cuda = f.trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert "cudnn" not in cpu.lower()
    assert ("__cudnn$fmha" in cuda) == (setting == "auto" and cudnn_loadable())


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("fp8rl_jax.models.attention_impl", fromlist=["x"]).cudnn_attention_available(),
                    reason="needs a CUDA GPU with cuDNN (none on this machine)")
def test_cudnn_attention_on_gpu_matches_float64():
    """On the GPU the cache-less bf16 forward runs cuDNN's fused attention (its custom call is in the compiled
    program) and equals the float64 formula with left padding; its gradients equal XLA attention's on every row
    (issue 36: 3.1x off through the bias path at 3d93a32), and the trainer's cuDNN call passes the forward + gradient
    check against float64 (:func:`check_attention_kernel`: left pads, an all-pad row, GQA, bf16)."""
    from fp8rl_jax.models import attention_impl as ai

    ai.check_attention_kernel(lambda q, k, v, m_: ai.left_padded_attention(q, k, v, m_, implementation="cudnn"))
    assert kernels_selftest_passed("cudnn_attention")
    cfg = ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=256, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, rope_theta=10000.0, qk_norm=True)
    dtype = jnp.bfloat16
    m = _attn(cfg, dtype)
    b, s = 3, 64
    x, mask = _inputs(cfg, b, s, pads=(0, 5, 30), dtype=dtype)
    pos = np.asarray(positions_from_mask(jnp.asarray(mask)))
    q_slots = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    args = (jnp.asarray(pos), rope_inv_freq(cfg), jnp.asarray(mask), q_slots)

    def run(impl):
        m.attention_implementation = impl
        f = jax.jit(lambda x: m(x, *args)[0])
        hlo = f.lower(x).compile().as_text()
        g = jax.jit(jax.grad(lambda x: jnp.sum(m(x, *args)[0].astype(jnp.float32) ** 2)))(x)
        return f(x), hlo, g

    out, hlo, g_cudnn = run("auto")
    assert "cudnn" in hlo.lower() and "fmha" in hlo.lower(), "the auto path did not run cuDNN attention"
    p = _p(m)
    q, k, v = _qkv_ref(p, cfg, np.asarray(x.astype(jnp.float32), np.float64), pos)
    _close(out, _attend_ref(p, cfg, q, k, v, mask, np.asarray(q_slots)), mask, dtype)
    _, hlo_xla, g_xla = run("xla")
    assert "fmha" not in hlo_xla.lower()
    ga, gb = (np.asarray(a.astype(jnp.float32), np.float64) for a in (g_cudnn, g_xla))
    assert np.linalg.norm(ga - gb) / np.linalg.norm(gb) < 3e-2


def test_train_config_attention_implementation_reaches_every_attention_module(tmp_path):
    """``train.attention_implementation`` is validated by name and set on the trainer model's attention modules."""
    from fp8rl_jax.models.decoder import Attention as Attn
    from fp8rl_jax.trainer.config import TrainConfig
    from fp8rl_jax.trainer.loop import RLTrainer
    from conftest import make_tiny_run_dir

    with pytest.raises(ValueError, match="attention_implementation"):
        TrainConfig(attention_implementation="flash")
    t = RLTrainer(TrainConfig(output_dir=str(tmp_path / "run"), model=make_tiny_run_dir(tmp_path / "m"),
                              attention_implementation="xla", num_steps=1, prompts_per_step=2, samples_per_prompt=2,
                              max_tokens=4, progress_bar=False, checkpoint_every=0, plots=False))
    mods = [mod for _, mod in nnx.iter_graph(t.model) if isinstance(mod, Attn)]
    assert mods and all(mod.attention_implementation == "xla" for mod in mods)


def test_large_gpu_fallback_to_xla_attention_is_warned_once(monkeypatch):
    """On a GPU, a cache-less forward that cuDNN cannot run and whose XLA scores are large warns (once per reason)."""
    import warnings

    from fp8rl_jax.models import attention_impl as ai

    monkeypatch.setattr(ai, "cudnn_attention_available", lambda: True)  # a GPU host
    monkeypatch.setattr(ai, "_max_head_dim", lambda: 128)
    ai._warn_fallback.cache_clear()
    with pytest.warns(UserWarning, match=r"materialises \[B, H, 8191, 8191\] scores: cuDNN needs even"):
        assert ai.resolve_attention_implementation("auto", jnp.bfloat16, 128, 8191, 8191, False) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ai.resolve_attention_implementation("auto", jnp.bfloat16, 128, 8191, 8191, False)  # once only
        ai.resolve_attention_implementation("auto", jnp.bfloat16, 128, 511, 511, False)    # small: silent


_CUDNN_COMPILE = r"""
import json, re, jax, jax.numpy as jnp
from fp8rl_jax.gpu_target import compile_for_h100
from fp8rl_jax.models import attention_impl as ai
S = jax.ShapeDtypeStruct
def loss(q, k, v, m):
    return jnp.sum(ai.left_padded_attention(q, k, v, m, implementation="cudnn").astype(jnp.float32) ** 2)
r = compile_for_h100(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), S((2, 256, 8, 128), jnp.bfloat16),
                     S((2, 256, 2, 128), jnp.bfloat16), S((2, 256, 2, 128), jnp.bfloat16), S((2, 256), jnp.bool_))
txt = r.compiled.as_text()
calls = [l for l in txt.splitlines() if "custom_call_target=\"__cudnn$fmha" in l]
print(json.dumps({"targets": sorted(set(re.findall(r'custom_call_target="(__cudnn[^"]+)"', txt))),
                  "operands": [l.split("operand_layout_constraints={")[1].split("}, api_version")[0] for l in calls],
                  "config": [l.split("backend_config=")[1][:2000] if "backend_config=" in l else "" for l in calls]}))
"""


def test_trainer_cudnn_call_compiles_for_h100_without_bias_or_mask():
    """Issue 36 (1), deviceless sm_90a compile in .venv-cuda: the trainer's cuDNN attention (forward and backward of
    :func:`left_padded_attention`) compiles to cuDNN's plain softmax fMHA with two ``s32[B]`` sequence-length operands
    and a causal padding mask: no ``[B, 1, S, T]`` bias operand (the path whose backward was wrong on the H200) and no
    bias gradient."""
    from conftest import run_in_cuda_venv

    res = run_in_cuda_venv(_CUDNN_COMPILE)
    assert res["targets"] == ["__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"], res["targets"]
    for ops, cfg in zip(res["operands"], res["config"]):
        assert ops.count("s32[2]") == 2 and "256,256" not in ops, ops  # seq lengths, no [B, 1, S, S] bias
        assert "PADDING_CAUSAL" in cfg, cfg[:500]
