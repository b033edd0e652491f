"""Decode attention over an e4m3 KV cache dequantized inside a Pallas kernel (fp8rl_jax/kernels/pallas_attention.py).

- numerics, Pallas interpret mode on the CPU, against an independent float64 numpy reference: attention over the
  dequantized cache (``ml_dtypes`` e4m3 values times the float32 scale, vLLM's FP8 KV semantics), GQA, left padding
  and causality masks, lengths that are not a multiple of the tile, several splits, bf16 / float32, FP8 attention;
- the embedded engine with an e4m3 cache: the kernel (interpret mode) against today's materialized path, tokens and
  logprobs;
- the CUDA lowering, checked on this CPU: one Triton launch per layer with the e4m3 -> bf16 conversion inside the
  kernel, and no whole-cache dequantization left in the lowered decode step;
- on a CUDA GPU (skipped without one; ``benchmarks/run_gpu.sh`` runs them): the compiled kernel at Qwen3-8B
  attention shapes and 4k-token contexts against the float64 reference, and the engine with ``kv_attention="auto"``.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from fp8rl_jax.export import export_weights
from hlo_calls import triton_launches
from fp8rl_jax.kernels.pallas_attention import decode_kernel_choice, fp8_kv_decode_attention, use_fp8_kv_kernel
from fp8rl_jax.kernels.registry import cuda_device
from fp8rl_jax.models.config import ModelConfig
from fp8rl_jax.models.decoder import Attention, KVCache, left_pad, named_params, set_qkv_capture
from fp8rl_jax.models.loading import build_model
from fp8rl_jax.rollout.engine import JaxRolloutEngine
from fp8rl_jax.rollout.types import SamplingParams

E4M3 = jnp.float8_e4m3fn
E4M3_NP = ml_dtypes.float8_e4m3fn
NEEDS_GPU = pytest.mark.skipif(cuda_device() is None, reason="needs a CUDA GPU (none on this machine)")

# Tolerances, as a fraction of max |V| (the attention output is a convex combination of V rows, so max |V| bounds it):
# - float32 compute: the scores, exp, sums and products are float32 operations (relative error ~1e-7 each, a few
#   hundred of them chained in a sum); 1e-5 leaves a margin of ~10x over the measured ~5e-7.
# - bf16 compute: the probabilities are cast to bf16 before the P.V product (relative error <= 2**-9 per term, so at
#   most 2**-9 * max |V| on the sum) and the output is rounded to bf16 (<= 2**-9 * |out| <= 2**-9 * max |V|): 2**-8.
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2.0 ** -8}


def _problem(rng, b, t, hkv, g, d, dtype, q_scale=None):
    """Random e4m3 caches with realistic magnitudes, scales, a left-padded mask and per-row query slots."""
    k_scale, v_scale = np.float32(rng.uniform(0.005, 0.05)), np.float32(rng.uniform(0.005, 0.05))
    kc = np.clip(rng.normal(size=(b, t, hkv, d)) * 120, -448, 448).astype(E4M3_NP)
    vc = np.clip(rng.normal(size=(b, t, hkv, d)) * 120, -448, 448).astype(E4M3_NP)
    q = (rng.normal(size=(b, hkv * g, d)) * 2.0).astype(np.float32)
    q = np.asarray(jnp.asarray(q, dtype).astype(jnp.float32))  # the values the kernel sees
    pad = rng.integers(0, t // 2, size=b)
    pad[0] = 0
    mask = np.arange(t)[None, :] >= pad[:, None]
    slot = np.array([rng.integers(pad[i], t) for i in range(b)])
    slot[-1] = t - 1  # one row sees the whole cache (the last, overhanging tile)
    return dict(q=q, kc=kc, vc=vc, ks=k_scale, vs=v_scale, mask=mask, slot=slot, qs=q_scale)


def _reference(p):
    """float64 attention over the dequantized cache (e4m3 * scale), softmax scale head_dim**-0.5, GQA groups of
    consecutive query heads; with ``qs`` the queries are first quantized to e4m3 (float32 division, RNE, saturated)."""
    q, b, hq, d = p["q"].astype(np.float64), *p["q"].shape
    if p["qs"] is not None:
        q = np.clip(p["q"] / np.float32(p["qs"]), -448, 448).astype(E4M3_NP).astype(np.float64) * float(p["qs"])
    k = p["kc"].astype(np.float64) * float(p["ks"])
    v = p["vc"].astype(np.float64) * float(p["vs"])
    g = hq // k.shape[2]
    out = np.zeros((b, hq, d))
    for i in range(b):
        visible = p["mask"][i] & (np.arange(k.shape[1]) <= p["slot"][i])
        for h in range(hq):
            s = k[i, :, h // g] @ q[i, h] / np.sqrt(d)
            s = np.where(visible, s, -np.inf)
            w = np.exp(s - s.max())
            out[i, h] = (w / w.sum()) @ v[i, :, h // g]
    return out


def _run(p, dtype, **kw):
    return fp8_kv_decode_attention(jnp.asarray(p["q"], dtype), jnp.asarray(p["kc"]), jnp.asarray(p["vc"]), p["ks"],
                                   p["vs"], jnp.asarray(p["mask"]), jnp.asarray(p["slot"]), q_scale=p["qs"], **kw)


# (B, T, H_kv, G, D, block_k, splits): T not a multiple of the tile, G = 1 / 3 / 4 / 8, one or many splits
SHAPES = [(3, 77, 2, 3, 32, 16, 2), (2, 40, 2, 2, 64, 128, None), (1, 16, 1, 1, 16, 16, 1), (2, 300, 4, 4, 128, 64, 3),
          (1, 200, 1, 8, 64, 32, 7)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:5])))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("fp8_q", [False, True], ids=["q", "q_e4m3"])
def test_kernel_matches_float64_reference(shape, dtype, fp8_q):
    b, t, hkv, g, d, block_k, splits = shape
    rng = np.random.default_rng(t * 31 + g)
    p = _problem(rng, b, t, hkv, g, d, dtype, q_scale=np.float32(0.01) if fp8_q else None)
    got = _run(p, dtype, block_k=block_k, splits=splits, interpret=True)
    assert got.shape == (b, hkv * g, d) and got.dtype == dtype
    want = _reference(p)
    bound = TOL[dtype] * np.abs(p["vc"].astype(np.float64) * float(p["vs"])).max()
    err = np.abs(np.asarray(got, np.float64) - want).max()
    assert err <= bound, (err, bound)


def test_splits_and_tiles_change_only_float32_rounding():
    rng = np.random.default_rng(5)
    p = _problem(rng, 2, 150, 2, 2, 32, jnp.float32)
    outs = [np.asarray(_run(p, jnp.float32, block_k=bk, splits=s, interpret=True))
            for bk, s in ((16, 1), (16, 10), (32, 3), (128, 2))]
    for o in outs[1:]:
        np.testing.assert_allclose(o, outs[0], rtol=0, atol=1e-5 * np.abs(outs[0]).max())


def test_a_row_without_visible_slot_gets_zeros():
    rng = np.random.default_rng(1)
    p = _problem(rng, 2, 32, 1, 2, 16, jnp.float32)
    p["mask"][1] = False
    got = np.asarray(_run(p, jnp.float32, block_k=16, interpret=True))
    assert np.isfinite(got).all() and (got[1] == 0).all()
    p0 = {k: (v[:1] if isinstance(v, np.ndarray) and v.ndim and k != "qs" else v) for k, v in p.items()}
    np.testing.assert_allclose(got[0], _reference(p0)[0], atol=1e-5 * np.abs(got[0]).max())


def test_bad_arguments_are_named():
    q, c, m, s = jnp.zeros((1, 4, 16)), jnp.zeros((1, 32, 2, 16), E4M3), jnp.ones((1, 32), bool), jnp.zeros(1, int)
    c24 = jnp.zeros((1, 32, 2, 24), E4M3)
    with pytest.raises(ValueError, match="needs an e4m3 cache"):
        fp8_kv_decode_attention(q, c.astype(jnp.bfloat16), c, 1.0, 1.0, m, s)
    with pytest.raises(ValueError, match="fewer than one 16-slot tile"):
        fp8_kv_decode_attention(q, c[:, :8], c[:, :8], 1.0, 1.0, m[:, :8], s)
    with pytest.raises(ValueError, match="head_dim 24 must be a power of two"):
        fp8_kv_decode_attention(jnp.zeros((1, 4, 24)), c24, c24, 1.0, 1.0, m, s)
    with pytest.raises(ValueError, match="does not fit the cache"):
        fp8_kv_decode_attention(jnp.zeros((1, 3, 16)), c, c, 1.0, 1.0, m, s)
    with pytest.raises(ValueError, match="kv_mask"):
        fp8_kv_decode_attention(q, c, c, 1.0, 1.0, m[:, :16], s)
    with pytest.raises(ValueError, match="block_k 24"):
        fp8_kv_decode_attention(q, c, c, 1.0, 1.0, m, s, block_k=24)


def test_kernel_choice():
    assert use_fp8_kv_kernel("auto") == "auto" == use_fp8_kv_kernel(None)
    assert use_fp8_kv_kernel("materialize") is None
    assert use_fp8_kv_kernel("interpret") == "interpret"
    assert use_fp8_kv_kernel("pallas") == "pallas"
    with pytest.raises(ValueError, match="kv_attention='flash' is not one of"):
        use_fp8_kv_kernel("flash")
    shape = (2, 64, 2, 64)
    assert decode_kernel_choice("interpret", 1, shape) == "interpret"
    assert decode_kernel_choice("auto", 1, shape) == "auto"
    assert decode_kernel_choice("interpret", 7, shape) == "interpret"  # prefill: fp8_kv_prefill_attention
    assert decode_kernel_choice("interpret", 1, (2, 8, 2, 64)) is None  # shorter than one tile
    assert decode_kernel_choice("interpret", 1, (2, 64, 2, 80)) is None  # head_dim not a power of two


# -- the engine ------------------------------------------------------------------------------------------------------

CFG = ModelConfig(model_type="qwen3", vocab_size=300, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, qk_norm=True, eos_token_id=5,
                  pad_token_id=0)
# left padding to 32 slots (prompt_bucket 16), 24 new tokens: a 56-slot cache, not a multiple of the 32-slot tile
PROMPTS = [[1, 2, 3], [4, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22], [11]]
GREEDY = SamplingParams(n=2, temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def model_and_scales():
    from fp8rl_jax.fp8.kv_cache import calibrate_kv_scales
    from fp8rl_jax.trainer.loop import qkv_row_absmax

    model = build_model(CFG, seed=1)
    set_qkv_capture(model)
    ids, mask = left_pad(PROMPTS, 0, bucket=16)
    scales = calibrate_kv_scales(np.asarray(qkv_row_absmax(model, jnp.asarray(ids), jnp.asarray(mask))))
    set_qkv_capture(model, False)
    return model, scales


def _generate(model, scales, precision, kv_attention, fp8_attention=False, sp=GREEDY):
    fmt = {"float32": "float32", "fp8": "fp8_blockwise"}[precision]
    eng = JaxRolloutEngine(CFG, export_weights(named_params(model), fmt, kv_scales=scales), precision=precision,
                           kv_cache_dtype="fp8_e4m3", fp8_attention=fp8_attention, kv_attention=kv_attention,
                           log_kv_cache=False)
    return eng, eng.generate(PROMPTS, sp)


@pytest.mark.parametrize("fp8_attention", [False, True], ids=["e4m3_kv", "e4m3_kv+fp8_attention"])
def test_engine_float32_kernel_equals_materialized_path(model_and_scales, fp8_attention):
    """float32 engine, e4m3 cache: the kernel (interpret mode) and today's path read the same e4m3 cache and differ
    only by float32 rounding, so greedy decoding gives the same tokens and logprobs within 1e-5 (measured <= 1e-6).
    With FP8 attention the queries are quantized to e4m3 in both: a 1-ulp float32 difference in a query (from the
    previous layer's attention, rounded differently) can flip one e4m3 code at a rounding boundary, changing that
    step's logits by ~1e-3 (measured: one step of 24, 2.6e-3 nats, query codes checked); hence there the bound is
    1e-5 for the median step and 1e-2 for the worst."""
    model, scales = model_and_scales
    eng, got = _generate(model, scales, "float32", "interpret", fp8_attention)
    assert all(m.kv_attention == "interpret" for m in _attention_modules(eng.model))
    _, want = _generate(model, scales, "float32", "materialize", fp8_attention)
    np.testing.assert_array_equal(got.response_token_ids, want.response_token_ids)
    diff = np.abs(got.rollout_logprobs - want.rollout_logprobs)
    if fp8_attention:
        assert np.median(diff) <= 1e-5 and diff.max() <= 1e-2, diff.max()
    else:
        assert diff.max() <= 1e-5, diff.max()


def test_engine_fp8_kernel_as_close_to_the_float32_model_as_materialized(model_and_scales):
    """FP8 engine (W8A8 linears, bf16 activations), e4m3 cache: both attention paths round to bf16 in different places
    (kernel: probabilities before P.V; materialized: the dequantized K/V and the normalized probabilities), so on this
    random model with near-uniform next-token distributions (logprobs ~ -5.5) greedy tokens may part at near-ties.
    What must hold: each path's rollout logprobs are as close to the float32 trainer's logprobs of its own tokens as
    the other's (measured mean gaps 0.016-0.022 nats for both, seeds 1-3); the kernel's gap may exceed the
    materialized path's by at most 25% + 0.005 nats, and both stay under 0.05 nats (bf16's ~0.01-nat level)."""
    from fp8rl_jax.trainer.logprobs import response_logprobs

    model, scales = model_and_scales
    gaps = {}
    for impl in ("interpret", "materialize"):
        _, rb = _generate(model, scales, "fp8", impl, sp=SamplingParams(n=1, temperature=0.0, max_tokens=20,
                                                                         ignore_eos=True))
        assert np.isfinite(rb.rollout_logprobs).all()
        pid, pm = left_pad(rb.prompt_token_ids, 0, bucket=16)
        ref = np.asarray(response_logprobs(model, jnp.asarray(pid), jnp.asarray(pm),
                                           jnp.asarray(rb.response_token_ids), 1.0))
        gaps[impl] = float(np.abs(ref - rb.rollout_logprobs).mean())
    assert gaps["interpret"] <= 1.25 * gaps["materialize"] + 5e-3 and max(gaps.values()) < 0.05, gaps


def test_engine_auto_keeps_todays_path_off_gpu(model_and_scales):
    """Computed on the CPU (the default device of these tests, also on a GPU host) ``"auto"`` runs the materialized
    path: bit-identical results."""
    model, scales = model_and_scales
    sp = SamplingParams(n=1, temperature=0.0, max_tokens=6, ignore_eos=True)
    eng, auto = _generate(model, scales, "float32", "auto", sp=sp)
    _, mat = _generate(model, scales, "float32", "materialize", sp=sp)
    assert eng.kv_attention == "auto"
    np.testing.assert_array_equal(auto.response_token_ids, mat.response_token_ids)
    np.testing.assert_array_equal(auto.rollout_logprobs, mat.rollout_logprobs)  # bit for bit: the same program
    with pytest.raises(ValueError, match="kv_attention='flash'"):
        _generate(model, scales, "float32", "flash")


def _attention_modules(model):
    from flax import nnx

    return [m for _, m in nnx.iter_modules(model) if isinstance(m, Attention)]


# -- CUDA lowering, checked on this CPU --------------------------------------------------------------------------------

S = jax.ShapeDtypeStruct


@pytest.mark.parametrize("fp8_q", [False, True], ids=["bf16_q", "e4m3_q"])
def test_kernel_lowers_to_one_triton_launch_reading_e4m3_for_cuda(fp8_q):
    """Qwen3-8B attention at a 4k context (B=2, T=4352, H_kv=8, G=4, D=128): one launch, grid (B, H_kv, splits); in
    a dynamic-trip-count loop the e4m3 [128, 128] tiles are converted to bf16 in registers (or fed to an e4m3 dot
    with FP8 attention) and multiplied on tensor cores with float32 accumulation; the cache enters the kernel as e4m3
    and nothing converts it outside."""
    from test_fp8_pallas import _lower_for_cuda

    b, t, hkv, g, d = 2, 4352, 8, 4, 128
    hlo, kernels = _lower_for_cuda(
        lambda q, kc, vc, ks, vs, m, sl: fp8_kv_decode_attention(q, kc, vc, ks, vs, m, sl,
                                                                 q_scale=0.01 if fp8_q else None, interpret=False),
        S((b, hkv * g, d), jnp.bfloat16), S((b, t, hkv, d), E4M3), S((b, t, hkv, d), E4M3), S((), jnp.float32),
        S((), jnp.float32), S((b, t), bool), S((b,), jnp.int32))
    assert len(kernels) == 1 and hlo.count("__gpu$xla.gpu.triton") == 1
    splits = -(-264 // (b * hkv))  # 17 splits of 2 tiles of 128 slots (34 tiles)
    assert f"grid_x = {b} : i32, grid_y = {hkv} : i32, grid_z = {splits} : i32" in hlo
    ir_text = kernels[0]
    assert re.search(r"tt\.func public @fp8_kv_decode_attention", ir_text)
    assert "scf.for" in ir_text
    tile = "tensor<128x128xf8E4M3FN>"
    dots = re.findall(r"tt\.dot .*: (tensor<\S+>) \* (tensor<\S+>) -> (tensor<\S+>)", ir_text)
    if fp8_q:
        assert dots == [("tensor<16x128xf8E4M3FN>", tile, "tensor<16x128xf32>"),
                        ("tensor<16x128xbf16>", "tensor<128x128xbf16>", "tensor<16x128xf32>")]
        assert len(re.findall(rf"tt\.fp_to_fp %\w+ : {tile} -> tensor<128x128xbf16>", ir_text)) == 1  # V only
    else:
        assert dots == [("tensor<16x128xbf16>", "tensor<128x128xbf16>", "tensor<16x128xf32>")] * 2
        assert len(re.findall(rf"tt\.fp_to_fp %\w+ : {tile} -> tensor<128x128xbf16>", ir_text)) == 2  # K and V
    assert not re.search(r"stablehlo\.convert .*tensor<2x4352x8x128xf8E4M3FN>", hlo)


def _triton_launches(hlo: str) -> int:
    """Triton custom calls executed by ``@main``, counted through the call graph (tests/hlo_calls.py)."""
    return sum(triton_launches(hlo).values())


def _cache_converts(hlo: str, shape: str) -> int:
    """``stablehlo.convert`` ops whose operand is a whole e4m3 cache ``shape`` (e.g. ``2x48x2x64``)."""
    return len(re.findall(rf"stablehlo\.convert %\S+ : \(tensor<{shape}xf8E4M3FN>\)", hlo))


@pytest.mark.parametrize("fp8_attention", [False, True], ids=["e4m3_kv", "e4m3_kv+fp8_attention"])
def test_decode_step_lowered_for_cuda_dequantizes_no_cache(fp8_attention):
    """One decode step of a bf16 Qwen3 model with an e4m3 cache, lowered for CUDA on this CPU: with
    ``kv_attention="auto"`` (as on a GPU) every layer is one launch of the attention kernel and no whole-cache
    ``[B, T, H_kv, D]`` e4m3 -> bf16/f32 convert is left; today's path (``"materialize"``) has two per layer."""
    from flax import nnx
    from test_fp8_pallas import _lower_for_cuda

    model = build_model(CFG, seed=0, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)
    layers = CFG.num_hidden_layers
    ones = jnp.ones((layers,), jnp.float32)
    cache = KVCache.zeros(CFG, 2, 48, E4M3, k_scale=ones, v_scale=ones, q_scale=ones if fp8_attention else None)
    shape = f"2x48x{CFG.num_key_value_heads}x{CFG.head_dim}"
    found = {}
    for impl in ("auto", "materialize"):
        for m in _attention_modules(model):
            m.kv_attention = impl
        graphdef, state = nnx.split(model)

        def step(state, tok, pos, kv_mask, cache, graphdef=graphdef):
            mod = nnx.merge(graphdef, state)
            h, cache = mod.hidden_states(tok, pos, kv_mask, cache, 40)
            return mod.logits(h[:, 0]), cache

        hlo, kernels = _lower_for_cuda(step, state, jnp.zeros((2, 1), jnp.int32), jnp.zeros((2, 1), jnp.int32),
                                       jnp.ones((2, 48), bool), cache)
        names = {re.search(r"tt\.func public @(\w+)", k).group(1) for k in kernels}
        assert names <= {"fp8_kv_decode_attention"}  # the dense bf16 linears are XLA dots
        found[impl] = (_triton_launches(hlo), _cache_converts(hlo, shape))
    assert found["auto"] == (layers, 0)
    assert found["materialize"] == (0, 2 * layers)


# -- on a CUDA GPU (skipped without one; benchmarks/run_gpu.sh runs them) ------------------------------------------------


@pytest.mark.gpu
@NEEDS_GPU
@pytest.mark.parametrize("fp8_q", [False, True], ids=["bf16_q", "e4m3_q"])
def test_on_gpu_kernel_matches_float64_reference_at_4k_context(fp8_q):
    """Compiled (Triton) at Qwen3-8B attention shapes, B=3, T=4352 (4k prompt + 256 new), rows filled to 4352, ~3000
    and ~700 slots with left padding: within the bf16 bound of the interpret-mode test (2**-8 * max |V|; the GPU's
    exp2 approximation adds ~2**-22 relative, far below)."""
    rng = np.random.default_rng(4)
    p = _problem(rng, 3, 4352, 8, 4, 128, jnp.bfloat16, q_scale=np.float32(0.01) if fp8_q else None)
    p["slot"] = np.array([4351, 3000, 700])
    p["mask"] = np.arange(4352)[None, :] >= np.array([0, 100, 37])[:, None]
    gpu = jax.devices("gpu")[0]
    with jax.default_device(gpu):
        got = _run(p, jnp.bfloat16, interpret=False)
        assert got.devices() == {gpu}
    bound = TOL[jnp.bfloat16] * np.abs(p["vc"].astype(np.float64) * float(p["vs"])).max()
    err = np.abs(np.asarray(got, np.float64) - _reference(p)).max()
    assert err <= bound, (err, bound)


@pytest.mark.gpu
@NEEDS_GPU
def test_on_gpu_engine_auto_uses_the_kernel_and_scores_like_materialized(model_and_scales):
    """On the GPU, ``kv_attention="auto"`` runs the kernel; greedy rollouts of the float32 engine with an e4m3 cache
    follow today's path: XLA's float32 attention on the GPU may use TF32 (~1e-3 relative) where the kernel's float32
    dots are IEEE, so greedy tokens may part at near-ties of this near-uniform random model; at least 90% of the
    positions must agree, and before each row's first difference the logprobs within 1e-2 nats on average (the level
    of the fused-projection GPU test)."""
    model, scales = model_and_scales
    gpu = jax.devices("gpu")[0]
    with jax.default_device(gpu):
        eng, got = _generate(model, scales, "float32", "auto")
        _, want = _generate(model, scales, "float32", "materialize")
    assert use_fp8_kv_kernel(eng.kv_attention) == (True, False)
    same = got.response_token_ids == want.response_token_ids
    assert same.mean() >= 0.9, same
    assert np.isfinite(got.rollout_logprobs).all()
    before = np.cumprod(same, axis=1).astype(bool)  # positions before a row's first difference
    assert np.abs(got.rollout_logprobs - want.rollout_logprobs)[before].mean() < 1e-2
