"""The embedded rollout engine vs the model's full forward (the reference), in float32, bf16 and FP8."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from fp8rl_jax.export import export_weights
from fp8rl_jax.models.config import ModelConfig
from fp8rl_jax.models.decoder import left_pad, named_params
from fp8rl_jax.models.loading import build_model
from fp8rl_jax.rollout.engine import JaxRolloutEngine, StaleWeightsError
from fp8rl_jax.rollout.sampling import process_logits
from fp8rl_jax.rollout.types import RolloutEngine, SamplingParams
from fp8rl_jax.trainer.logprobs import response_logprobs

CFG = ModelConfig(model_type="qwen3", vocab_size=300, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, eos_token_id=5, pad_token_id=0)
PROMPTS = [[1, 2, 3], [4, 6, 7, 8, 9, 10, 11, 12, 13, 14], [11]]


@pytest.fixture(scope="module")
def model():
    return build_model(CFG, seed=1)


def _engine(model, precision):
    fmt = {"float32": "float32", "bf16": "bf16", "fp8": "fp8_blockwise"}[precision]
    return JaxRolloutEngine(CFG, export_weights(named_params(model), fmt), precision=precision)


def test_engine_satisfies_protocol(model):
    assert isinstance(_engine(model, "float32"), RolloutEngine)


def test_greedy_tokens_equal_argmax_of_full_forward(model):
    eng = _engine(model, "float32")
    rb = eng.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    for prompt, resp in zip(rb.prompt_token_ids, rb.response_token_ids):
        # the reference: the whole sequence through the cache-less forward once; by causality its logits at position
        # len(prompt) - 1 + i are those of the prefix that chose response token i (one forward per prompt instead of
        # one per token: each new length was an eager op-by-op run, 90 s of this test)
        seq = list(prompt) + [int(t) for t in resp]
        logits = np.asarray(model(jnp.asarray([seq])))[0]
        np.testing.assert_array_equal(np.argmax(logits[len(prompt) - 1:-1], axis=-1), np.asarray(resp, np.int64))
    assert (rb.response_mask == 1).all() and rb.finish_reason == ["length"] * 3


def _logprob_gap(model, rb):
    pid, pm = left_pad(rb.prompt_token_ids, 0)
    lp = np.asarray(response_logprobs(model, jnp.asarray(pid), jnp.asarray(pm), jnp.asarray(rb.response_token_ids),
                                      0.7))
    return np.abs((lp - rb.rollout_logprobs) * rb.response_mask).max()


def test_rollout_logprobs_equal_trainer_logprobs_float32_and_differ_in_fp8(model):
    sp = SamplingParams(n=3, temperature=0.7, max_tokens=12, seed=0)
    rb32 = _engine(model, "float32").generate(PROMPTS, sp)
    assert rb32.response_token_ids.shape == (9, 12) and rb32.rollout_logprobs.dtype == np.float32
    assert _logprob_gap(model, rb32) < 1e-4
    gap_bf16 = _logprob_gap(model, _engine(model, "bf16").generate(PROMPTS, sp))
    gap_fp8 = _logprob_gap(model, _engine(model, "fp8").generate(PROMPTS, sp))
    assert 1e-3 < gap_fp8 < 1.0 and 1e-4 < gap_bf16 < 1.0


def test_stop_tokens_and_response_mask(model):
    eng = _engine(model, "float32")
    rb = eng.generate(PROMPTS, SamplingParams(n=4, temperature=1.5, max_tokens=20, seed=3, stop_token_ids=(7, 8, 9)))
    stops = {7, 8, 9, 5}
    for row, mrow, reason in zip(rb.response_token_ids, rb.response_mask, rb.finish_reason):
        n = int(mrow.sum())
        assert (mrow[:n] == 1).all() and (mrow[n:] == 0).all()
        inside = [int(t) for t in row[:n]]
        assert not stops & set(inside[:-1])  # nothing stops before the end
        assert (reason == "stop") == (inside[-1] in stops)
        assert (row[n:] == 0).all()  # pad after the end
    assert (rb.rollout_logprobs[rb.response_mask == 0] == 0).all()
    assert list(rb.prompt_index) == [0] * 4 + [1] * 4 + [2] * 4


def test_top_k_top_p_match_numpy_reference(rng):
    logits = rng.normal(size=(4, 50)).astype(np.float32) * 3
    out = np.asarray(process_logits(jnp.asarray(logits), jnp.float32(0.8), jnp.int32(10), jnp.float32(0.6), True, True))
    for row, got in zip(logits, out):
        x = row.astype(np.float64) / 0.8
        keep = x >= np.sort(x)[::-1][9]  # top-k
        xs = np.where(keep, x, -np.inf)
        order = np.argsort(-xs)
        p = np.exp(xs[order] - xs[order][0])
        p /= p.sum()
        before = np.cumsum(p) - p
        kept = set(order[before < 0.6])  # smallest prefix reaching top_p
        assert set(np.nonzero(got > -1e29)[0]) == kept


def test_update_weights_changes_generation_and_checks_input(model):
    eng = _engine(model, "fp8")
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    before = eng.generate(PROMPTS, sp)
    other = build_model(CFG, seed=7)
    w = export_weights(named_params(other), "fp8_blockwise", version=1)
    eng.update_weights(w)
    after = eng.generate(PROMPTS, sp, expected_version=1)
    assert after.weights_version == 1
    assert not np.array_equal(before.response_token_ids, after.response_token_ids)
    with pytest.raises(StaleWeightsError, match="version 1"):
        eng.generate(PROMPTS, sp, expected_version=2)
    with pytest.raises(ValueError, match="fp8_blockwise"):
        eng.update_weights(export_weights(named_params(other), "bf16"))
    bad = dict(w.tensors)
    bad.pop("model.norm.weight")
    with pytest.raises(ValueError, match="missing.*model.norm.weight"):
        eng.update_weights(type(w)(tensors=bad, format=w.format))
    bad = dict(w.tensors)
    bad["model.norm.weight"] = jnp.ones((7,))
    with pytest.raises(ValueError, match="shape mismatch for model.norm.weight"):
        eng.update_weights(type(w)(tensors=bad, format=w.format))


def test_bad_prompts_raise(model):
    eng = _engine(model, "float32")
    with pytest.raises(ValueError, match="at least one token"):
        eng.generate([[1], []], SamplingParams())
    with pytest.raises(ValueError, match="token ids must be in"):
        eng.generate([[1, 300]], SamplingParams())
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)


def test_export_refuses_non_finite(model):
    params = dict(named_params(model))
    params["model.layers.0.mlp.up_proj.weight"] = params["model.layers.0.mlp.up_proj.weight"].at[0, 0].set(jnp.nan)
    with pytest.raises(ValueError, match="up_proj.weight"):
        export_weights(params, "fp8_blockwise")


def test_fp8_export_layout(model):
    w = export_weights(named_params(model), "fp8_blockwise")
    q = w.tensors["model.layers.0.self_attn.k_proj.weight"]
    s = w.tensors["model.layers.0.self_attn.k_proj.weight_scale_inv"]
    assert q.dtype == jnp.float8_e4m3fn and q.shape == (128, 256) and s.shape == (1, 2) and s.dtype == jnp.float32
    assert w.tensors["model.embed_tokens.weight"].dtype == jnp.bfloat16
    assert "model.embed_tokens.weight_scale_inv" not in w.tensors


def test_sampling_noise_is_keyed_by_row_so_split_batches_sample_the_same(model):
    """Row r's noise is fold_in(fold_in(key(seed), row_offset + r), step): generating the prompts in two calls
    (row_offset = first prompt * n, as each process does in a multi-process rollout) or in KV-budget chunks gives
    the whole batch's tokens; a different row_offset gives different samples."""
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 12, 13, 14, 15], [16, 17, 18, 19, 20]]  # equal lengths
    sp = SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=11, ignore_eos=True)
    fmt = export_weights(named_params(model), "float32")
    eng = JaxRolloutEngine(CFG, fmt, precision="float32")
    whole = eng.generate(prompts, sp)
    first, second = eng.generate(prompts[:2], sp), eng.generate(prompts[2:], sp, row_offset=4)
    np.testing.assert_array_equal(np.concatenate([first.response_token_ids, second.response_token_ids]),
                                  whole.response_token_ids)
    np.testing.assert_allclose(np.concatenate([first.rollout_logprobs, second.rollout_logprobs]),
                               whole.rollout_logprobs, atol=1e-5)
    assert (eng.generate(prompts[2:], sp).response_token_ids != second.response_token_ids).any()
    # a KV budget of 4 sequences of 16 + 8 tokens: the batch runs in chunks, with the same samples
    budget = 4 * 32 * 2 * CFG.num_hidden_layers * CFG.num_key_value_heads * CFG.head_dim * 4
    chunked = JaxRolloutEngine(CFG, fmt, precision="float32", kv_cache_memory_bytes=budget)
    rb = chunked.generate(prompts, sp)
    assert chunked.last_num_chunks > 1
    np.testing.assert_array_equal(rb.response_token_ids, whole.response_token_ids)
    with pytest.raises(ValueError, match="row_offset"):
        eng.generate(prompts, sp, row_offset=-1)


def test_float64_forward_scores_the_engine_and_catches_a_wrong_scale():
    """The reference of the GPU engine test (test_fp8_gpu.py::test_engine_on_gpu_scores_like_a_float64_forward), on the
    CPU: a float64 numpy forward of the served tensors (tests/numpy_decoder_ref.py, no project code) equals the float32
    engine's teacher-forced logprobs to 1e-4; with the logits far from uniform (final norm x8: logprobs -11 +- 3), the
    FP8 engine is within 0.3 nats of it on average, and the same engine with one doubled ``weight_scale_inv`` is more
    than 3x further away: the comparison sees a wrong scale, which near-uniform logits (every logprob ~ -ln(vocab))
    hide."""
    from numpy_decoder_ref import logprobs64

    from fp8rl_jax.export import export_weights
    from fp8rl_jax.models.config import ModelConfig
    from fp8rl_jax.models.decoder import named_params
    from fp8rl_jax.models.loading import build_model
    from fp8rl_jax.rollout.engine import ENGINE_PRECISIONS, JaxRolloutEngine

    cfg = ModelConfig(model_type="qwen3", vocab_size=512, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                      rope_theta=1e6, tie_word_embeddings=True, eos_token_id=5, pad_token_id=0, qk_norm=True)
    params = {k: np.asarray(v) for k, v in named_params(build_model(cfg, seed=0)).items()}
    params["model.norm.weight"] = params["model.norm.weight"] * 8
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(6, 512, 24))), list(map(int, rng.integers(6, 512, 9)))]
    conts = [list(map(int, rng.integers(6, 512, 8))), list(map(int, rng.integers(6, 512, 5)))]

    def error(precision, served=None):
        w = export_weights(params, ENGINE_PRECISIONS[precision][2])
        ref = np.concatenate([logprobs64(cfg, w.tensors, p, c) for p, c in zip(prompts, conts)])
        if served is not None:  # the engine serves altered tensors; the reference keeps the exported ones
            w = type(w)(served(dict(w.tensors)), w.format, w.block_size, 0, dict(w.metadata))
        eng = JaxRolloutEngine(cfg, w, precision=precision, log_kv_cache=False)
        return float(np.mean(np.abs(np.concatenate(eng.score(prompts, conts)) - ref))), ref

    err32, ref = error("float32")
    assert err32 < 1e-4
    assert ref.std() > 1.0 and ref.mean() < -np.log(cfg.vocab_size) - 1.0  # far from uniform
    err8, _ = error("fp8")
    name = "model.layers.1.mlp.down_proj.weight_scale_inv"
    bad, _ = error("fp8", lambda t: dict(t, **{name: t[name] * 2.0}))
    assert err8 < 0.3 and bad > 3 * err8, (err8, bad)
