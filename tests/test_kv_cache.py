"""FP8 (e4m3) KV cache: quantization, attention error, capacity, calibration, export names, engine, trainer sync.

References: ``ml_dtypes`` e4m3 casts and float64 numpy formulas; HF ``transformers`` attention inputs (q/k/v
after QK-norm and RoPE, captured through its attention-function registry) for calibration; vLLM's own
checkpoint-name mapper (``QuantizationConfig.get_cache_scale_mapper``) for the exported names.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from conftest import make_hf_model, make_tiny_run_dir
from fp8rl_jax.export import export_weights
from fp8rl_jax.fp8 import quantize_weight_blockwise
from fp8rl_jax.fp8.kv_cache import (KVScales, calibrate_kv_scales, calibration_statistic, dequantize_kv,
                                    kv_cache_bytes_per_token, kv_cache_capacity, masked_row_absmax, quantize_kv)
from fp8rl_jax.models.config import ModelConfig
from fp8rl_jax.models.decoder import KVCache, named_params, rope_inv_freq, set_qkv_capture
from fp8rl_jax.models.hf_io import load_hf_dir
from fp8rl_jax.models.loading import build_model
from fp8rl_jax.rollout.engine import JaxRolloutEngine, StaleKVScalesError
from fp8rl_jax.rollout.types import SamplingParams
from fp8rl_jax.trainer.logprobs import left_pad, response_logprobs
from fp8rl_jax.trainer.loop import qkv_row_absmax

E4M3_NP = ml_dtypes.float8_e4m3fn
CFG = ModelConfig(model_type="qwen3", vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, qk_norm=True, eos_token_id=5,
                  pad_token_id=0)
PROMPTS = [[1, 2, 3, 9, 10], [4, 6, 7, 8, 9, 10, 11, 12], [11, 40], [7, 7, 7]]
GREEDY = SamplingParams(n=2, temperature=0.0, max_tokens=8, ignore_eos=True)


def _ref_quant(x, scale):
    """vLLM's cache write in numpy: float32 ``x / scale`` saturated to +-448, RNE cast to e4m3 (ml_dtypes)."""
    return np.clip(np.asarray(x, np.float32) / np.float32(scale), -448, 448).astype(E4M3_NP)


# ----------------------------------------------------------------------------------------------- numerics
def test_quantize_kv_bits_and_error_bound(rng):
    x = (rng.standard_normal((3, 7, 2, 16)) * np.exp(rng.uniform(-6, 4, (3, 7, 2, 16)))).astype(np.float32)
    x[0, 0, 0, :4] = [1e6, -1e6, 0.0, 1e-30]  # saturation, zero, underflow
    scale = np.float32(np.abs(x[1:]).max() / 448)
    q = np.asarray(quantize_kv(jnp.asarray(x), scale))
    ref = _ref_quant(x, scale)
    assert q.dtype == ref.dtype and np.array_equal(q.view(np.uint8), ref.view(np.uint8))
    deq32 = np.asarray(dequantize_kv(jnp.asarray(q), scale, jnp.float32))
    assert np.array_equal(deq32, ref.astype(np.float32) * np.float32(scale))  # float32 product, as vLLM reads
    deq = deq32.astype(np.float64)
    # e4m3: 3 mantissa bits -> half-ulp relative error 2**-4 for normals; subnormal step 2**-9 (times scale)
    inside = np.abs(x.astype(np.float64)) <= 448 * scale
    err = np.abs(deq - x)[inside]
    assert np.all(err <= 2.0**-4 * np.abs(x[inside]) + 2.0**-10 * scale * 1.0001)
    assert deq[0, 0, 0, 0] == pytest.approx(448 * scale) and deq[0, 0, 0, 1] == pytest.approx(-448 * scale)


def test_calibration_statistics_match_formulas(rng):
    a = rng.uniform(0.1, 10, (37, 4, 3))
    np.testing.assert_array_equal(calibration_statistic(a, "amax"), a.max(0))
    for p in (0.0, 50.0, 99.9, 100.0):  # NeMo-RL's nearest rank: sorted[round(p/100 * (n-1))]
        np.testing.assert_array_equal(calibration_statistic(a, "percentile", p),
                                      np.sort(a, 0)[int(round(p / 100 * 36))])
    rows = rng.uniform(0, 5, (4, 3, 10))  # [L, (q,k,v), sequences]
    s = calibrate_kv_scales([rows[..., :6], rows[..., 6:]], "amax")
    np.testing.assert_allclose(s.k_scale, rows[:, 1].max(-1) / 448, rtol=1e-6)
    np.testing.assert_allclose(s.q_scale, rows[:, 0].max(-1) / 448, rtol=1e-6)
    s = calibrate_kv_scales(rows, "percentile", 50.0)  # default margin 1.05 (NeMo-RL)
    np.testing.assert_allclose(s.v_scale, np.sort(rows[:, 2], -1)[:, int(round(0.5 * 9))] * 1.05 / 448, rtol=1e-6)
    tok = rng.uniform(0, 1, (2, 3, 4, 5)).astype(np.float32)
    mask = rng.uniform(size=(4, 5)) > 0.4
    np.testing.assert_array_equal(np.asarray(masked_row_absmax(jnp.asarray(tok), jnp.asarray(mask))),
                                  np.where(mask[None, None], tok, 0).max(-1))
    with pytest.raises(ValueError, match="percentile"):
        calibration_statistic(a, "percentile", 101)
    with pytest.raises(ValueError, match="median"):
        calibration_statistic(a, "median")
    with pytest.raises(ValueError, match=r"\[L, 3, B, S\]"):
        masked_row_absmax(jnp.asarray(tok), jnp.asarray(mask[:, :4]))


def test_capacity_is_twice_bf16_minus_scale_storage():
    # SmolLM2-135M geometry: 30 layers, 3 kv heads, head_dim 64
    L, H, D, bs = 30, 3, 64, 16
    assert kv_cache_bytes_per_token(L, H, D, "auto", "bfloat16") == 2 * L * H * D * 2 == 23040
    assert kv_cache_bytes_per_token(L, H, D, "fp8", "bfloat16") == 11520
    for budget in (2**20, 10**8, 23040 * 16 * 1000 + 3 * L * 4, 2**30 + 12345):
        bf, f8 = (kv_cache_capacity(L, H, D, budget, d, "bfloat16", 2048, bs) for d in ("auto", "fp8_e4m3"))
        blocks_bf = math.floor(budget / (23040.0 * bs))
        blocks_f8 = math.floor((budget - 3 * L * 4) / (11520.0 * bs))
        assert (bf.num_tokens, f8.num_tokens) == (blocks_bf * bs, blocks_f8 * bs)
        assert f8.max_concurrency == pytest.approx(blocks_f8 / math.ceil(2048 / bs))
        assert f8.scale_bytes == 360 and bf.scale_bytes == 0
        # exactly 2x, less what the 360 bytes of scales cost (at most one fp8 page)
        assert 2 * bf.num_tokens - bs <= f8.num_tokens <= 2 * bf.num_tokens + bs
    aligned = kv_cache_capacity(L, H, D, 23040 * bs * 1000 + 360, "fp8_e4m3", "bfloat16", 2048, bs)
    assert aligned.num_tokens == 2 * kv_cache_capacity(L, H, D, 23040 * bs * 1000, "auto", "bfloat16").num_tokens
    assert "tokens" in aligned.report() and "maximum concurrency" in aligned.report()
    with pytest.raises(ValueError, match="fp8_e5m2"):
        kv_cache_capacity(L, H, D, 2**20, "fp8_e5m2")


# ----------------------------------------------------------------------------------------------- attention
@pytest.fixture(scope="module")
def model():
    return build_model(CFG, seed=3)


def test_attention_fp8_cache_vs_full_precision_cache(model, rng):
    """Same weights, same inputs: the e4m3 cache holds exactly vLLM's quantized k/v and the attention output's
    relative error stays within e4m3 bounds (and above bf16's)."""
    attn = model.model.layers[1].self_attn
    b, s, t = 2, 11, 16
    x = jnp.asarray(rng.standard_normal((b, s, CFG.hidden_size)), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    kv_mask = jnp.ones((b, t), bool)
    q_slots = pos
    inv = rope_inv_freq(CFG)
    zeros = lambda dt: jnp.zeros((b, t, CFG.num_key_value_heads, CFG.head_dim), dt)  # noqa: E731
    out_ref, (k_ref, v_ref) = attn(x, pos, inv, kv_mask, q_slots, (zeros(jnp.float32), zeros(jnp.float32)), 0)
    ks = float(jnp.abs(k_ref).max()) / 448
    vs = float(jnp.abs(v_ref).max()) / 448
    out8, (k8, v8) = attn(x, pos, inv, kv_mask, q_slots,
                          (zeros(jnp.float8_e4m3fn), zeros(jnp.float8_e4m3fn), ks, vs, None), 0)
    assert np.array_equal(np.asarray(k8).view(np.uint8), _ref_quant(k_ref, ks).view(np.uint8))
    assert np.array_equal(np.asarray(v8).view(np.uint8), _ref_quant(v_ref, vs).view(np.uint8))
    out_bf, _ = attn(x, pos, inv, kv_mask, q_slots, (zeros(jnp.bfloat16), zeros(jnp.bfloat16)), 0)
    out_fa, _ = attn(x, pos, inv, kv_mask, q_slots,
                     (zeros(jnp.float8_e4m3fn), zeros(jnp.float8_e4m3fn), ks, vs, ks * 2.0), 0)  # FP8 attention
    ref = np.asarray(out_ref, np.float64)
    rel = lambda o: np.linalg.norm(np.asarray(o, np.float64) - ref) / np.linalg.norm(ref)  # noqa: E731
    print(f"attention rel. error vs f32 cache: bf16 {rel(out_bf):.2e}, fp8 kv {rel(out8):.2e}, "
          f"fp8 kv+q {rel(out_fa):.2e}")
    assert 0 < rel(out_bf) < rel(out8) < 2.0**-4
    assert rel(out8) < rel(out_fa) < 2 * 2.0**-4


def test_kv_cache_requires_scales():
    with pytest.raises(ValueError, match="k_scale and v_scale"):
        KVCache.zeros(CFG, 1, 4, jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"shape \(2,\)"):
        KVCache.zeros(CFG, 1, 4, jnp.float8_e4m3fn, k_scale=jnp.ones(3), v_scale=jnp.ones(2))


def test_kv_cache_holds_each_layers_scales_as_its_own_scalar():
    """KVCache.zeros splits the [num_layers] scales into per-layer float32 scalars (issue 37 item 5: XLA then builds a
    layer's cache-write and attention kernels once for all layers), inside jit too; values and layer(i) unchanged."""
    ks, vs, qs = (np.array([0.5, 3.0]), np.array([0.25, 7.0]), np.array([1.5, 2.0]))

    @jax.jit
    def build(k_scale, v_scale, q_scale):
        c = KVCache.zeros(CFG, 1, 4, jnp.float8_e4m3fn, k_scale=k_scale, v_scale=v_scale, q_scale=q_scale)
        return c.k_scale, c.v_scale, c.q_scale, c.layer(1)[2:]

    # one barrier over all of them: without it XLA fuses each layer's slice into that layer's fusions
    assert str(jax.make_jaxpr(build)(ks, vs, qs)).count("optimization_barrier") == 1
    k, v, q, layer1 = build(ks, vs, qs)
    for got, want in ((k, ks), (v, vs), (q, qs)):
        assert isinstance(got, tuple) and len(got) == CFG.num_hidden_layers
        assert all(g.shape == () and g.dtype == jnp.float32 for g in got)
        assert [float(g) for g in got] == want.tolist()
    assert [float(x) for x in layer1] == [3.0, 7.0, 2.0]
    c = KVCache.zeros(CFG, 1, 4, jnp.float8_e4m3fn, k_scale=ks, v_scale=vs)
    k0, v0, q0 = c.layer(0)[2:]
    assert c.q_scale is None and q0 is None and (float(k0), float(v0)) == (0.5, 0.25)


# ----------------------------------------------------------------------------------------------- calibration
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_captured_qkv_maxima_match_transformers(tmp_path, arch):
    """q/k/v maxima captured from our training forward == maxima of the q/k/v that HF's attention receives
    (after QK-norm and RoPE), on the same weights, with left padding excluded."""
    import torch
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    seen = {}

    def capture(module, query, key, value, attention_mask, **kw):
        seen[module.layer_idx] = [t.abs().amax(dim=(1, 3)).numpy() for t in (query, key, value)]  # [B, S]
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register("kv_capture_test", capture)
    hf = make_hf_model(arch)
    hf.save_pretrained(tmp_path)
    hf.set_attn_implementation("kv_capture_test")
    cfg, params, _ = load_hf_dir(str(tmp_path))
    ours = build_model(cfg, params)
    set_qkv_capture(ours)
    rows = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
    ids, mask = left_pad(rows, 0, bucket=8)
    got = np.asarray(qkv_row_absmax(ours, jnp.asarray(ids), jnp.asarray(mask)))  # [L, 3, B]
    for b, r in enumerate(rows):
        with torch.no_grad():
            hf(torch.tensor([r]))
        for i in range(cfg.num_hidden_layers):
            np.testing.assert_allclose(got[i, :, b], [m[0].max() for m in seen[i]], rtol=2e-5)


# ----------------------------------------------------------------------------------------------- export
def test_export_carries_scales_under_vllm_names_and_stays_bit_identical(model):
    params = named_params(model)
    scales = KVScales(np.array([0.01, 0.02], np.float32), np.array([0.03, 0.04], np.float32),
                      np.array([0.05, 0.06], np.float32))
    ew = export_weights(params, "fp8_blockwise", version=7, kv_scales=scales)
    assert ew.metadata["kv_scales_version"] == 7
    per_tensor = jax.jit(quantize_weight_blockwise, static_argnums=1)
    for name, w in params.items():  # batched (one call per shape group) == per-tensor quantization, bitwise
        if name.endswith("proj.weight"):
            q, s = per_tensor(w, 128)
            assert np.array_equal(np.asarray(ew.tensors[name]).view(np.uint8), np.asarray(q).view(np.uint8)), name
            assert np.array_equal(np.asarray(ew.tensors[name + "_scale_inv"]), np.asarray(s)), name
    names = sorted(k for k in ew.tensors if k.endswith("_scale") and "weight" not in k)
    assert names == sorted(f"model.layers.{i}.self_attn.{c}_scale" for i in range(2) for c in "kvq")
    assert float(ew.tensors["model.layers.1.self_attn.v_scale"]) == pytest.approx(0.04)
    # vLLM's loader maps these checkpoint names onto its attention layer's scale parameters
    base_config = pytest.importorskip("vllm.model_executor.layers.quantization.base_config",
                                      reason="needs the [vllm] extra")
    mapper = base_config.QuantizationConfig.get_cache_scale_mapper()
    for n in names:
        assert mapper._map_name(n) == n.replace(".self_attn.", ".self_attn.attn."), n


# ----------------------------------------------------------------------------------------------- engine
def _scales_for(model, prompts):
    set_qkv_capture(model)
    ids, mask = left_pad(prompts, 0, bucket=8)
    s = calibrate_kv_scales(np.asarray(qkv_row_absmax(model, jnp.asarray(ids), jnp.asarray(mask))))
    set_qkv_capture(model, False)
    return s


@pytest.fixture(scope="module")
def engines(model):
    scales = _scales_for(model, PROMPTS)
    ew = export_weights(named_params(model), "float32", version=0, kv_scales=scales)
    auto = JaxRolloutEngine(CFG, ew, precision="float32", prompt_bucket=8)
    fp8 = JaxRolloutEngine(CFG, ew, precision="float32", prompt_bucket=8, kv_cache_dtype="fp8_e4m3")
    return {"auto": auto, "fp8": fp8, "scales": scales, "weights": ew}


def test_engine_fp8_cache_logprobs_close_to_trainer(model, engines):
    """Rollout logprobs with the e4m3 cache vs the trainer's full-precision forward on the sampled tokens."""
    gaps = {}
    for kind in ("auto", "fp8"):
        rb = engines[kind].generate(PROMPTS, GREEDY)
        pid, pmask = left_pad(rb.prompt_token_ids, 0, bucket=8)
        ref = np.asarray(response_logprobs(model, jnp.asarray(pid), jnp.asarray(pmask),
                                           jnp.asarray(rb.response_token_ids), 1.0))
        m = rb.response_mask > 0
        gaps[kind] = float(np.abs(rb.rollout_logprobs - ref)[m].mean())
    print(f"mean |rollout_logprobs - trainer logprobs|: auto {gaps['auto']:.2e}, fp8_e4m3 {gaps['fp8']:.2e}")
    assert gaps["auto"] < 1e-4 < gaps["fp8"] < 0.05


def test_engine_refuses_stale_scales_and_applies_new_ones_in_place(model, engines):
    eng, ew = engines["fp8"], engines["weights"]
    plain = export_weights(named_params(model), "float32", version=1)  # weights without scales
    eng.update_weights(plain)
    with pytest.raises(StaleKVScalesError, match="version 0 but the weights are version 1"):
        eng.generate(PROMPTS[:1], GREEDY)
    doubled = KVScales(*(2 * np.asarray(a) for a in engines["scales"]))
    eng.update_weights(export_weights(named_params(model), "float32", version=1, kv_scales=doubled))
    assert eng.kv_scales_version == 1
    np.testing.assert_array_equal(np.asarray(eng.kv_scales.k_scale), doubled.k_scale)
    eng.generate(PROMPTS[:1], GREEDY)
    bad = dict(ew.tensors)
    bad["model.layers.0.self_attn.k_scale"] = np.float32(-1.0)
    with pytest.raises(ValueError, match="k_scale must be finite and > 0"):
        eng.update_weights(type(ew)(bad, "float32", version=2))
    assert eng.weights_version == 1  # a rejected update leaves the engine as it was
    del bad["model.layers.1.self_attn.v_scale"]
    bad["model.layers.0.self_attn.k_scale"] = np.float32(1.0)
    with pytest.raises(ValueError, match=r"v_scale missing for layers \[1\]"):
        eng.update_weights(type(ew)(bad, "float32", version=2))
    eng.update_weights(ew)  # back to the fixture's state
    eng.set_kv_scales(engines["scales"], 0)
    with pytest.raises(ValueError, match="fp8_attention=True needs kv_cache_dtype='fp8_e4m3'"):
        JaxRolloutEngine(CFG, ew, precision="float32", fp8_attention=True, log_kv_cache=False)
    with pytest.raises(ValueError, match="kv_cache_dtype='int8' is not supported"):
        JaxRolloutEngine(CFG, ew, precision="float32", kv_cache_dtype="int8", log_kv_cache=False)


def test_byte_budget_fp8_runs_twice_the_sequences(engines, capsys):
    """One byte budget: the e4m3 cache runs the batch in one pass, the bf16-sized cache needs two; chunking
    does not change greedy results."""
    ew = engines["weights"]
    seq = 8 + GREEDY.max_tokens  # prompt bucket 8 + response
    f32_bytes_per_token = kv_cache_bytes_per_token(2, 2, 16, "auto", "float32")
    budget = 4 * 2 * seq * kv_cache_bytes_per_token(2, 2, 16, "fp8_e4m3") + 24  # 8 fp8 sequences + scales
    f8 = JaxRolloutEngine(CFG, ew, precision="float32", prompt_bucket=8, kv_cache_dtype="fp8_e4m3",
                          kv_cache_memory_bytes=budget)
    auto = JaxRolloutEngine(CFG, ew, precision="float32", prompt_bucket=8,
                            kv_cache_memory_bytes=budget * 4 // 2)  # f32 = 4x fp8 bytes, so half the sequences
    out = capsys.readouterr().out
    assert "a bf16 cache would hold" in out and "maximum concurrency" in out
    assert f8.kv_capacity.max_sequences(seq) == 8 == 2 * auto.kv_capacity.max_sequences(seq)
    assert auto.kv_capacity.bytes_per_token == f32_bytes_per_token
    rb8, rba = f8.generate(PROMPTS, GREEDY), auto.generate(PROMPTS, GREEDY)
    assert (f8.last_num_chunks, auto.last_num_chunks) == (1, 2)
    np.testing.assert_array_equal(rb8.response_token_ids, engines["fp8"].generate(PROMPTS, GREEDY).response_token_ids)
    np.testing.assert_array_equal(rba.response_token_ids, engines["auto"].generate(PROMPTS, GREEDY).response_token_ids)
    with pytest.raises(ValueError, match="fewer than the n=16 samples"):
        f8.generate(PROMPTS[:1], SamplingParams(n=16, temperature=0.0, max_tokens=8))


# ----------------------------------------------------------------------------------------------- trainer
def test_trainer_recalibrates_and_syncs_scales_every_step(tmp_path_factory):
    from fp8rl_jax.trainer import RLTrainer, TrainConfig

    d = make_tiny_run_dir(tmp_path_factory.mktemp("kv_tiny"), "qwen3")
    cfg = TrainConfig(output_dir=str(tmp_path_factory.mktemp("kv_run")), model=d, num_steps=2, prompts_per_step=2,
                      samples_per_prompt=2, max_tokens=4, rollout_precision="bf16", learning_rate=1e-3,
                      progress_bar=False, checkpoint_every=0, kv_cache_dtype="fp8_e4m3")
    tr = RLTrainer(cfg)
    assert tr.engine.kv_scales_version == tr.engine.weights_version == 0
    before = np.asarray(tr.engine.kv_scales.v_scale).copy()
    # change the weights: layer 1's v_proj x4 -> its captured |v| and so its v_scale must grow ~4x
    vp = tr.model.model.layers[1].self_attn.v_proj.weight
    vp[...] = vp[...] * 4.0
    for step in (1, 2):
        m = tr.step()
        assert np.isfinite(m["rollout_corr/k3_kl"])
        assert tr.engine.weights_version == tr.engine.kv_scales_version == tr.kv_scales_version == step
        np.testing.assert_array_equal(np.asarray(tr.engine.kv_scales.k_scale), tr.kv_scales.k_scale)
    ratio = np.asarray(tr.engine.kv_scales.v_scale) / before
    assert 2.0 < ratio[1] < 8.0 and 0.5 < ratio[0] < 2.0, ratio
    assert "kv_scales" in tr.extra_state()
    # weights synced without recalibration (no training forward since) are refused by the engine
    tr.step_count += 1
    tr.engine.update_weights(tr.export())
    with pytest.raises(StaleKVScalesError):
        tr.engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
