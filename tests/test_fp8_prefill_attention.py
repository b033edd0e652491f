"""Issue 29: the FP8 KV cache read inside the attention kernel at prefill too (``fp8_kv_prefill_attention``).

Interpret mode on the CPU against a float64 numpy reference of attention over the dequantized cache (e4m3 * scale,
GQA groups of consecutive query heads, per-query causal slots, left padding); the engine's prefill through the kernel
against the materialized path; the CUDA lowering of an FP8-cache prefill: one kernel launch per layer and no
whole-cache e4m3 -> bf16 convert.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from fp8rl_jax.kernels.pallas_attention import fp8_kv_prefill_attention

E4M3 = jnp.float8_e4m3fn


def _problem(rng, b, s, t, hkv, g, d, q_scale=None):
    q = rng.standard_normal((b, s, hkv * g, d)).astype(np.float32)
    kc, vc = (rng.standard_normal((b, t, hkv, d)).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
              for _ in range(2))
    mask = np.ones((b, t), bool)
    mask[0, :3] = False  # left padding of row 0
    first = t - s - rng.integers(0, t - s - 3, size=b)  # the chunk's slots end before T
    slots = (first[:, None] + np.arange(s)[None]).astype(np.int32)
    return dict(q=q, kc=kc, vc=vc, ks=np.float32(0.05), vs=np.float32(0.02), mask=mask, slots=slots, qs=q_scale)


def _reference(p):
    q = p["q"].astype(np.float64)
    if p["qs"] is not None:  # e4m3 queries: float32 division, round to nearest even, saturated
        q = np.clip(p["q"] / np.float32(p["qs"]), -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
        q = q * float(p["qs"])
    g = q.shape[2] // p["kc"].shape[2]
    k = np.repeat(p["kc"].astype(np.float64) * float(p["ks"]), g, axis=2)
    v = np.repeat(p["vc"].astype(np.float64) * float(p["vs"]), g, axis=2)
    sc = np.einsum("bshd,bthd->bsht", q, k) / np.sqrt(q.shape[-1])
    t = k.shape[1]
    vis = p["mask"][:, None, :] & (np.arange(t)[None, None, :] <= p["slots"][:, :, None])
    sc = np.where(vis[:, :, None, :], sc, -np.inf)
    w = np.exp(sc - sc.max(-1, keepdims=True))
    return np.einsum("bsht,bthd->bshd", w / w.sum(-1, keepdims=True), v), np.abs(v).max()


@pytest.mark.parametrize("shape", [(2, 5, 40, 2, 2, 64, 16, 16), (1, 33, 70, 1, 4, 32, 32, 64),
                                   (2, 17, 48, 2, 3, 16, 16, 16)], ids=lambda s: "x".join(map(str, s[:6])))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("fp8_q", [False, True], ids=["q", "q_e4m3"])
def test_prefill_kernel_matches_float64(shape, dtype, fp8_q):
    """Tolerance: float32 softmax and accumulation (1e-5 of max |V|); bf16 queries, probabilities and P.V operands
    round to 8 bits (2e-2 of max |V|); the e4m3 queries are the reference's own, so they add nothing."""
    b, s, t, hkv, g, d, bk, rows = shape
    p = _problem(np.random.default_rng(s * 7 + t), b, s, t, hkv, g, d, q_scale=np.float32(0.01) if fp8_q else None)
    if dtype == jnp.bfloat16:  # the values the kernel sees
        p["q"] = np.asarray(jnp.asarray(p["q"], dtype).astype(jnp.float32))
    got = fp8_kv_prefill_attention(jnp.asarray(p["q"], dtype), jnp.asarray(p["kc"]), jnp.asarray(p["vc"]), p["ks"],
                                   p["vs"], jnp.asarray(p["mask"]), jnp.asarray(p["slots"]), q_scale=p["qs"],
                                   block_k=bk, block_rows=rows, interpret=True)
    assert got.shape == (b, s, hkv * g, d) and got.dtype == dtype
    want, vmax = _reference(p)
    tol = (1e-5 if dtype == jnp.float32 else 2e-2) * vmax
    assert np.abs(np.asarray(got, np.float64) - want).max() <= tol


def test_prefill_arguments_are_named():
    c, m = jnp.zeros((1, 32, 2, 16), E4M3), jnp.ones((1, 32), bool)
    q, s = jnp.zeros((1, 3, 4, 16)), jnp.zeros((1, 3), jnp.int32)
    with pytest.raises(ValueError, match="needs an e4m3 cache"):
        fp8_kv_prefill_attention(q, c.astype(jnp.bfloat16), c, 1.0, 1.0, m, s)
    with pytest.raises(ValueError, match=r"q_slots \(1, 2\)"):
        fp8_kv_prefill_attention(q, c, c, 1.0, 1.0, m, s[:, :2])
    with pytest.raises(ValueError, match="block_rows 24 must be a power of two"):
        fp8_kv_prefill_attention(q, c, c, 1.0, 1.0, m, s, block_rows=24)


def test_fp8_cache_prefill_lowered_for_cuda_reads_the_cache_in_the_kernel():
    """A prefill chunk of a bf16 Qwen3 model with an e4m3 cache, lowered for CUDA (``kv_attention="auto"``): every
    layer is one attention kernel launch, and no whole-cache ``[B, T, H_kv, D]`` e4m3 -> bf16 convert is left (the
    materialized path has two per layer)."""
    import re

    from flax import nnx

    from fp8rl_jax.models.config import ModelConfig
    from fp8rl_jax.models.decoder import Attention, KVCache
    from fp8rl_jax.models.loading import build_model
    from hlo_calls import triton_launches
    from test_fp8_pallas import _lower_for_cuda

    cfg = ModelConfig(model_type="qwen3", vocab_size=300, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, qk_norm=True, eos_token_id=5,
                      pad_token_id=0)
    model = build_model(cfg, seed=0, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)
    ones = jnp.ones((2,), jnp.float32)
    cache = KVCache.zeros(cfg, 2, 48, E4M3, k_scale=ones, v_scale=ones)
    shape = f"2x48x{cfg.num_key_value_heads}x{cfg.head_dim}"
    found = {}
    for impl in ("auto", "materialize"):
        for _, m in nnx.iter_modules(model):
            if isinstance(m, Attention):
                m.kv_attention = impl
        graphdef, state = nnx.split(model)

        def step(state, tok, pos, kv_mask, cache, graphdef=graphdef):
            mod = nnx.merge(graphdef, state)
            h, cache = mod.hidden_states(tok, pos, kv_mask, cache, 0)
            return mod.logits(h[:, -1]), cache

        hlo, kernels = _lower_for_cuda(step, state, jnp.zeros((2, 16), jnp.int32),
                                       jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (2, 16)),
                                       jnp.ones((2, 48), bool), cache)
        names = [re.search(r"tt\.func public @(\w+)", k).group(1) for k in kernels]
        converts = len(re.findall(rf"stablehlo\.convert %\S+ : \(tensor<{shape}xf8E4M3FN>\)", hlo))
        found[impl] = (triton_launches(hlo)["all"], converts, set(names))
    assert found["auto"][0] == cfg.num_hidden_layers and found["auto"][2] == {"fp8_kv_prefill_attention"}
    assert found["auto"][1] == 0
    assert found["materialize"][0] == 0 and found["materialize"][1] == 2 * cfg.num_hidden_layers
