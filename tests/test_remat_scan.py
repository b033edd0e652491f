"""Remat policies and scanned layers change memory, never results.

Reference: the plain Python loop over layers (no ``jax.checkpoint``, no scan), itself checked against HF
``transformers`` in tests/test_model_parity.py and tests/test_moe.py. Dense tiny Qwen3, an all-sparse tiny
Qwen3-MoE (scanned), and a dense + sparse MoE mix (falls back to the loop). Memory: XLA's compiled
``memory_analysis().temp_size_in_bytes`` of the loss gradient shrinks with ``remat_policy="full"``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from fp8rl_jax.models.config import ModelConfig
from fp8rl_jax.models.decoder import (CausalLM, KVCache, positions_from_mask, qkv_absmax_from_intermediates,
                                      set_qkv_capture)
from fp8rl_jax.models.loading import build_model
from fp8rl_jax.models.moe import tiny_qwen3_moe_config
from fp8rl_jax.models.remat import REMAT_POLICIES

V = 96


def _dense(layers=3):
    return ModelConfig(model_type="qwen3", vocab_size=V, hidden_size=64, intermediate_size=96,
                       num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       qk_norm=True)


CFGS = {
    "dense": _dense(),
    "moe": tiny_qwen3_moe_config(V, num_hidden_layers=3),
    "moe_mixed": dataclasses.replace(tiny_qwen3_moe_config(V, num_hidden_layers=3), mlp_only_layers=(1,)),
}


def _batch(b=2, s=10, seed=0):
    rng = np.random.default_rng(seed)
    ids = jnp.asarray(rng.integers(0, V, (b, s)), jnp.int32)
    mask = np.ones((b, s), bool)
    mask[1, :3] = False  # left padding
    mask = jnp.asarray(mask)
    return ids, positions_from_mask(mask), mask


def _loss_grad(model, ids, pos, mask, routed=None):
    def loss(m):
        h, _, rid = m.hidden_states(ids, pos, mask, routed_experts=routed, return_routing=True)
        lp = jax.nn.log_softmax(m.logits(h))
        tgt = jnp.roll(ids, -1, axis=1)
        return -jnp.sum(jnp.take_along_axis(lp, tgt[..., None], -1)[..., 0] * mask) / jnp.sum(mask), (lp, rid)

    (l, (lp, rid)), g = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(model)
    return l, lp, rid, nnx.to_flat_state(g)


def _model(cfg, **kw):
    return build_model(cfg, seed=1, **kw)


def _assert_tree_close(a, b, rtol=1e-5, atol=1e-6):
    pa, pb = dict(a), dict(b)
    assert pa.keys() == pb.keys()
    for k in pa:
        np.testing.assert_allclose(np.asarray(pa[k][...]), np.asarray(pb[k][...]), rtol=rtol, atol=atol,
                                   err_msg=str(k))


@pytest.fixture(scope="module")
def plain_loop_reference():
    """``arch -> _loss_grad`` of the plain loop on ``_batch()``, computed once per architecture (the same reference
    for every policy of that architecture)."""
    refs = {}

    def get(arch):
        if arch not in refs:
            refs[arch] = _loss_grad(_model(CFGS[arch]), *_batch())
        return refs[arch]

    return get


@pytest.mark.parametrize("arch,policy,scan", [
    ("dense", "full", False), ("dense", "dots_with_no_batch_dims_saveable", False), ("dense", "none", True),
    ("dense", "save_qkv_proj", True), ("moe", "full", True), ("moe", "dots_saveable", False),
    ("moe_mixed", "full", True),  # dense + sparse mix: scan falls back to the (rematted) loop
])
def test_logits_and_grads_equal_plain_loop(plain_loop_reference, arch, policy, scan):
    cfg = CFGS[arch]
    ids, pos, mask = _batch()
    ref = plain_loop_reference(arch)
    got = _loss_grad(_model(cfg, remat_policy=policy, scan_layers=scan), ids, pos, mask)
    np.testing.assert_allclose(float(got[0]), float(ref[0]), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(ref[1]), rtol=1e-5, atol=1e-5)
    if cfg.num_experts:
        np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(ref[2]))  # router top-k per layer
    else:
        assert got[2] is None and ref[2] is None
    _assert_tree_close(got[3], ref[3])


def test_routing_replay_through_scan_equals_loop():
    """R3: a recorded [B, S, L, k] routing (other than the model's own) replays identically under scan + remat."""
    cfg = CFGS["moe"]
    ids, pos, mask = _batch(seed=3)
    rng = np.random.default_rng(5)
    b, s = ids.shape
    routed = np.stack([rng.permutation(cfg.num_experts)[:cfg.num_experts_per_tok] for _ in range(b * s * 3)])
    routed = routed.reshape(b, s, 3, cfg.num_experts_per_tok).astype(np.int32)
    routed[0, :4] = -1  # no record: routed normally
    routed = jnp.asarray(routed)
    ref = _loss_grad(_model(cfg), ids, pos, mask, routed)
    got = _loss_grad(_model(cfg, remat_policy="full", scan_layers=True), ids, pos, mask, routed)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(ref[1]), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(ref[2]))
    _assert_tree_close(got[3], ref[3])


@pytest.mark.parametrize("arch", ["dense", "moe_mixed"])
def test_qkv_capture_under_scan_and_remat(arch):
    """The per-layer q/k/v maxima sown for FP8 KV calibration are found at the usual paths and equal the loop's."""
    cfg = CFGS[arch]
    ids, pos, mask = _batch()
    out = []
    for kw in ({}, dict(remat_policy="full", scan_layers=True)):
        m = _model(cfg, **kw)
        set_qkv_capture(m, True)
        fwd = nnx.jit(nnx.capture(lambda mm: mm.hidden_states(ids, pos, mask)[0], nnx.Intermediate))
        _, inter = fwd(m)
        out.append(np.asarray(qkv_absmax_from_intermediates(inter, cfg.num_hidden_layers)))
    assert out[0].shape == (cfg.num_hidden_layers, 3) + ids.shape
    np.testing.assert_allclose(out[1], out[0], rtol=1e-6, atol=1e-6)


def test_cached_decode_ignores_remat_and_scan():
    """The engine path (KV cache) runs the plain loop whatever the settings: same logits and cache."""
    cfg = CFGS["dense"]
    ids, pos, mask = _batch()
    b, s = ids.shape
    kv_mask = jnp.concatenate([mask, jnp.zeros((b, 4), bool)], axis=1)
    outs = []
    for kw in ({}, dict(remat_policy="full", scan_layers=True)):
        m = _model(cfg, **kw)
        logits, cache = m(ids, pos, kv_mask, KVCache.zeros(cfg, b, s + 4), 0)
        outs.append((np.asarray(logits), np.asarray(cache.k[1])))
    np.testing.assert_array_equal(outs[0][0], outs[1][0])
    np.testing.assert_array_equal(outs[0][1], outs[1][1])


def test_bad_remat_policy_is_named():
    with pytest.raises(ValueError, match="'everything'.*full"):
        CausalLM(CFGS["dense"], remat_policy="everything")
    m = CausalLM(CFGS["dense"])
    m.remat_policy = "bogus"
    ids, pos, mask = _batch()
    with pytest.raises(ValueError, match="'bogus'"):
        m.hidden_states(ids, pos, mask)
    assert "none" in REMAT_POLICIES and "full" in REMAT_POLICIES


def _grad_temp_bytes(cfg, b, s, **kw):
    model = _model(cfg, **kw)
    graphdef, params = nnx.split(model)
    ids = jnp.zeros((b, s), jnp.int32)
    mask = jnp.ones((b, s), bool)
    pos = positions_from_mask(mask)

    def loss(p):
        m = nnx.merge(graphdef, p)
        return jnp.mean(m.logits(m.hidden_states(ids, pos, mask)[0])[..., 0])

    compiled = jax.jit(jax.value_and_grad(loss)).lower(params).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_full_remat_lowers_gradient_temp_memory():
    """Memory, not timing: with several layers, remat="full" keeps only each layer's input for the backward.

    Under ``lax.scan`` the saving is large (the backward recomputes one layer at a time). In the unrolled loop
    XLA:CPU schedules the recomputations freely and the saving is small (measured 27.8 -> 26.9 MiB here), so only
    "not larger" is asserted there.
    """
    cfg = _dense(layers=6)
    none = _grad_temp_bytes(cfg, 4, 128)
    full = _grad_temp_bytes(cfg, 4, 128, remat_policy="full")
    full_scan = _grad_temp_bytes(cfg, 4, 128, remat_policy="full", scan_layers=True)
    assert full <= none, (full, none)
    assert full_scan < 0.5 * none, (full_scan, none)


@pytest.mark.parametrize("arch", ["dense", "moe"])
def test_fp8_training_product_under_remat_and_scan(arch):
    """FP8 training (the custom-VJP dot_general on every layer Linear) runs under remat + scan. The recomputed
    forward can differ from the stored one by float32 rounding, which may flip single e4m3/bf16 roundings, so
    gradients agree to 1% of each tensor's largest entry (measured: 0.3%), not bit for bit."""
    from fp8rl_jax.trainer.precision import apply_train_precision

    ids, pos, mask = _batch()
    outs = []
    for kw in ({}, dict(remat_policy="full", scan_layers=True)):
        m = _model(CFGS[arch], **kw)
        apply_train_precision(m, "fp8")
        outs.append(_loss_grad(m, ids, pos, mask))
    np.testing.assert_allclose(float(outs[1][0]), float(outs[0][0]), rtol=1e-5)
    ref, got = dict(outs[0][3]), dict(outs[1][3])
    for k in ref:
        a, b = np.asarray(ref[k][...]), np.asarray(got[k][...])
        assert np.abs(a - b).max() <= 1e-2 * np.abs(a).max() + 1e-12, k


def test_train_config_knobs_reach_the_trainer_and_change_no_result(tmp_path):
    """train.remat_policy / train.scan_layers / train.logprobs_chunk_size: the trainer's model runs with them and
    one RL step gives the same loss and gradient norm as the defaults (float32 rollout, fixed seeds)."""
    from conftest import make_tiny_smollm2_vocab_dir
    from fp8rl_jax.trainer import RLTrainer, TrainConfig
    from test_checkpoint import fixed_length_dataset, text_reward

    with pytest.raises(ValueError, match="remat_policy"):
        TrainConfig(remat_policy="everything")
    model = make_tiny_smollm2_vocab_dir(tmp_path / "m")
    out = []
    for kw in ({}, {"remat_policy": "full", "scan_layers": True, "logprobs_chunk_size": 3}):
        cfg = TrainConfig(output_dir=str(tmp_path / "r"), model=model, num_steps=1, prompts_per_step=2,
                          samples_per_prompt=2, max_tokens=4, rollout_precision="float32", progress_bar=False,
                          seed=1, **kw)
        tr = RLTrainer(cfg, dataset=fixed_length_dataset())
        tr.reward_fn = text_reward
        assert (tr.model.remat_policy, tr.model.scan_layers) == (cfg.remat_policy, cfg.scan_layers)
        out.append(tr.step())
    for key in ("actor/loss", "actor/grad_norm", "rollout_corr/k3_kl"):
        np.testing.assert_allclose(out[1][key], out[0][key], rtol=1e-4, atol=1e-7)
