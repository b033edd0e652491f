"""Rollout routing replay (R3, arXiv 2510.11370) for Qwen3-MoE: the engine's routing record, the trainer's replayed
forward (gate weights from its own router, gradients to the router), ``rollout_corr/routing_mismatch``, dense
models untouched, the gin binding. References are float64 numpy transcriptions and finite differences."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from flax import nnx

from fp8rl_jax.export import export_weights
from fp8rl_jax.models.decoder import named_params, positions_from_mask, rope_inv_freq
from fp8rl_jax.models.loading import build_model
from fp8rl_jax.models.moe import (SparseMoeBlock, replay_gate_weights, route_top_k, route_with_replay,
                                  tiny_qwen3_moe_config, write_tiny_qwen3_moe)
from fp8rl_jax.objectives.metrics import routing_mismatch
from fp8rl_jax.rollout.engine import JaxRolloutEngine
from fp8rl_jax.rollout.types import SamplingParams
from fp8rl_jax.trainer.logprobs import (left_pad, response_logprobs, response_logprobs_and_routing,
                                        sequence_routing)

VOCAB = 97


def _moe(seed=0, **kw):
    cfg = tiny_qwen3_moe_config(VOCAB, eos_token_id=3, pad_token_id=0, **kw)
    return cfg, build_model(cfg, seed=seed)


def _rollout(cfg, model, precision="float32", n=2, max_tokens=6, seed=1):
    fmt = {"float32": "float32", "fp8": "fp8_blockwise", "bf16": "bf16"}[precision]
    eng = JaxRolloutEngine(cfg, export_weights(named_params(model), fmt), precision=precision, prompt_bucket=8,
                           log_kv_cache=False)
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
    rb = eng.generate(prompts, SamplingParams(n=n, max_tokens=max_tokens, seed=seed, temperature=1.0))
    return rb


def _np_softmax(z):
    z = z - z.max(-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(-1, keepdims=True)


# -- routing primitives -------------------------------------------------------------------------------------


@pytest.mark.parametrize("norm", [True, False])
def test_replay_of_own_choice_is_bit_identical_and_minus_one_routes_normally(norm):
    logits = jax.random.normal(jax.random.key(0), (40, 8)) * 3
    w, ids = route_top_k(logits, 3, norm)
    w2, used, own = route_with_replay(logits, 3, norm, ids)
    assert np.array_equal(np.asarray(w2), np.asarray(w)) and np.array_equal(np.asarray(used), np.asarray(ids))
    # other recorded ids: used verbatim, weights = float64 softmax gathered (and renormalised iff norm)
    rec = np.array(jax.random.randint(jax.random.key(1), (40, 3), 0, 8))
    rec[:, 1] = (rec[:, 0] + 1) % 8
    rec[:, 2] = (rec[:, 0] + 2) % 8
    rec[::5] = -1  # no record: route normally
    w3, used3, own3 = route_with_replay(logits, 3, norm, jnp.asarray(rec))
    p = _np_softmax(np.asarray(logits, np.float64))
    ref = np.take_along_axis(p, np.maximum(rec, 0), -1)
    if norm:
        ref = ref / ref.sum(-1, keepdims=True)
    has = (rec >= 0).all(-1)
    np.testing.assert_allclose(np.asarray(w3)[has], ref[has], rtol=2e-6, atol=1e-7)
    assert np.array_equal(np.asarray(used3)[has], rec[has])
    assert np.array_equal(np.asarray(used3)[~has], np.asarray(ids)[~has])
    assert np.array_equal(np.asarray(w3)[~has], np.asarray(w)[~has])
    assert np.array_equal(np.asarray(own3), np.asarray(ids))  # the router's own choice, for the metric


def test_routing_mismatch_vs_numpy():
    rng = np.random.default_rng(0)
    b, t, n_layers, k = 3, 5, 3, 2
    rec = np.stack([rng.permutation(6)[:k] for _ in range(b * t * n_layers)]).reshape(b, t, n_layers, k)
    tr = rec[..., ::-1].copy()  # same sets, other order: no mismatch
    tr[0, 1, 0] = [5, 4] if set(rec[0, 1, 0]) != {4, 5} else [0, 1]
    tr[2, 3, 2, 0] = (tr[2, 3, 2, 1] + 1) % 6 if (tr[2, 3, 2, 1] + 1) % 6 not in rec[2, 3, 2] else (tr[2, 3, 2, 1] + 2) % 6
    rec[1, 0, :] = -1  # no record at (1, 0)
    tr[1, 0, :] = 0
    mask = np.ones((b, t), np.float32)
    mask[2, 4] = 0
    tr[2, 4, 1] = [5, 5]  # masked: ignored
    got = float(routing_mismatch(tr, rec, mask, moe_layers=(0, 2)))
    per = []
    for layer in (0, 2):
        m = (mask > 0) & (rec[:, :, layer] >= 0).all(-1)
        d = np.array([[set(tr[i, j, layer]) != set(rec[i, j, layer]) for j in range(t)] for i in range(b)])
        per.append((d & m).sum() / m.sum())
    assert got == pytest.approx(np.mean(per), abs=1e-7) and got > 0
    assert float(routing_mismatch(tr, rec, np.zeros((b, t)))) == 0.0
    with pytest.raises(ValueError):
        routing_mismatch(tr[:, :4], rec, mask)


# -- the engine's record ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def moe8():
    """``(cfg, model, rollout)``: the 8-expert top-2 model and its float32 rollout (n=2, 6 tokens), shared by the
    tests that only read them (built and compiled once; no test changes the model)."""
    cfg, model = _moe(num_experts=8, num_experts_per_tok=2)
    return cfg, model, _rollout(cfg, model)


def _manual_forward(model, ids, kv_mask, routed):
    """Layer-by-layer cache-less forward replaying ``routed`` [B, S, L, k]; returns each layer's router input."""
    positions = positions_from_mask(kv_mask)
    b, s = ids.shape
    inv = rope_inv_freq(model.config)
    q_slots = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    x = model.model.embed_tokens(ids).astype(model.dtype)
    router_in = []
    for i, layer in enumerate(model.model.layers):
        a, _ = layer.self_attn(layer.input_layernorm(x), positions, inv, kv_mask, q_slots)
        x = x + a
        xn = layer.post_attention_layernorm(x)
        router_in.append(np.asarray(xn, np.float64))
        y, _ = layer.mlp.forward(xn, routed[:, :, i])
        x = x + y
    return router_in


def test_engine_records_top_k_of_float64_router(moe8):
    """float32 engine (prefill + every decode step): the recorded ids are the top-k of a float64 numpy router
    (softmax of ``x @ gate.T``) on the hidden states of the same path (the record replayed through a cache-less
    forward); near-ties (float64 margin < 1e-4) are the only allowed exceptions, and must be rare."""
    cfg, model, rb = moe8
    n, t, n_layers, k = rb.routed_experts.shape
    assert (n_layers, k) == (cfg.num_hidden_layers, 2) and rb.routed_experts.dtype == np.int32
    assert [len(p) for p in rb.prompt_routed_experts] == [len(p) for p in rb.prompt_token_ids]
    mask = rb.response_mask > 0
    assert (rb.routed_experts[~mask] == -1).all() and (rb.routed_experts[mask] >= 0).all()
    pid, pmask = left_pad(rb.prompt_token_ids, 0, bucket=8)
    routed = sequence_routing(rb.prompt_routed_experts, rb.routed_experts, pid.shape[1])
    ids = jnp.asarray(np.concatenate([pid, rb.response_token_ids], 1))
    kv_mask = jnp.asarray(np.concatenate([pmask, np.ones_like(mask)], 1))
    router_in = _manual_forward(model, ids, kv_mask, jnp.asarray(routed))
    real = np.concatenate([pmask, mask], 1)
    checked = ties = 0
    for i, layer in enumerate(model.model.layers):
        g = np.asarray(layer.mlp.gate.weight[...], np.float64)
        probs = _np_softmax(router_in[i] @ g.T)
        order = np.argsort(-probs, -1, kind="stable")
        srt = np.take_along_axis(probs, order, -1)
        for bi, si in zip(*np.nonzero(real)):
            checked += 1
            if srt[bi, si, k - 1] - srt[bi, si, k] < 1e-4:
                ties += 1
                continue
            assert set(order[bi, si, :k]) == set(routed[bi, si, i]), (i, bi, si)
            assert list(order[bi, si, :k]) == list(routed[bi, si, i])  # descending-probability order too
    assert checked > 50 and ties <= checked // 50


def test_dense_engine_records_nothing():
    from fp8rl_jax.models.config import ModelConfig

    cfg = ModelConfig(model_type="qwen3", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      eos_token_id=3, pad_token_id=0, qk_norm=True)
    rb = _rollout(cfg, build_model(cfg, seed=0))
    assert rb.routed_experts is None and rb.prompt_routed_experts is None


# -- the trainer's replayed forward --------------------------------------------------------------------------


def _batch(rb):
    pid, pmask = left_pad(rb.prompt_token_ids, 0, bucket=8)
    routed = sequence_routing(rb.prompt_routed_experts, rb.routed_experts, pid.shape[1])
    return jnp.asarray(pid), jnp.asarray(pmask), jnp.asarray(rb.response_token_ids), jnp.asarray(routed)


def test_replayed_trainer_forward_reproduces_rollout_path(moe8):
    """Same float32 weights: the replayed forward gives the rollout's logprobs (cache-less vs KV cache: float32
    rounding only), its own routing equals the record (routing_mismatch 0), and replay of the own choice is
    bit-identical to no replay."""
    cfg, model, rb = moe8
    pid, pmask, rid, routed = _batch(rb)
    lp_r, own = response_logprobs_and_routing(model, pid, pmask, rid, 1.0, routed)
    mask = rb.response_mask > 0
    assert np.abs(np.asarray(lp_r) - rb.rollout_logprobs)[mask].max() < 1e-4
    p = pid.shape[1]
    assert float(routing_mismatch(own[:, p:], routed[:, p:], rb.response_mask)) == 0.0
    lp_n, own_n = response_logprobs_and_routing(model, pid, pmask, rid, 1.0, None)
    real = np.concatenate([np.asarray(pmask), mask], 1)
    assert np.array_equal(np.asarray(own_n)[real], np.asarray(routed)[real])
    assert np.array_equal(np.asarray(lp_n)[mask], np.asarray(lp_r)[mask])


def test_fp8_rollout_replay_runs_the_recorded_experts(moe8):
    """FP8 rollout vs float32 trainer: where the trainer's own top-k differs from the record, the replayed forward
    still runs exactly the recorded experts (checked per block), and its logprobs move towards the rollout's."""
    cfg, model, _ = moe8
    rb = _rollout(cfg, model, precision="fp8", max_tokens=8)
    pid, pmask, rid, routed = _batch(rb)
    blk = model.model.layers[1].mlp
    x = jax.random.normal(jax.random.key(3), routed.shape[:2] + (cfg.hidden_size,))
    logits = blk.gate(x.reshape(-1, cfg.hidden_size))
    _, used, _ = route_with_replay(logits, 2, True, routed[:, :, 1].reshape(-1, 2))
    has = np.asarray(routed[:, :, 1] >= 0).all(-1).reshape(-1)
    assert np.array_equal(np.asarray(used)[has], np.asarray(routed[:, :, 1]).reshape(-1, 2)[has])
    lp_r = np.asarray(response_logprobs(model, pid, pmask, rid, 1.0, routed))
    lp_n = np.asarray(response_logprobs(model, pid, pmask, rid, 1.0))
    m = rb.response_mask > 0
    assert np.isfinite(lp_r[m]).all()
    assert np.abs(lp_r - rb.rollout_logprobs)[m].mean() <= np.abs(lp_n - rb.rollout_logprobs)[m].mean() + 1e-6


def _np_block(x, gate, wg, wu, wd, ids, norm):
    """float64 numpy Qwen3-MoE block with fixed experts ``ids [T, k]`` (R3 replay)."""
    probs = _np_softmax(x @ gate.T)
    w = np.take_along_axis(probs, ids, -1)
    if norm:
        w = w / w.sum(-1, keepdims=True)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j, e in enumerate(ids[t]):
            g, u = x[t] @ wg[e].T, x[t] @ wu[e].T
            out[t] += w[t, j] * ((g / (1 + np.exp(-g)) * u) @ wd[e].T)
    return out


@pytest.mark.parametrize("norm", [True, False])
def test_router_gradient_under_replay_matches_float64_finite_differences(norm):
    cfg = tiny_qwen3_moe_config(VOCAB, hidden_size=16, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=8)
    cfg = dataclasses.replace(cfg, norm_topk_prob=norm)
    blk = SparseMoeBlock(cfg, linear_precision="dense", param_dtype=jnp.float32, dtype=jnp.float32, rngs=nnx.Rngs(0))
    blk.gate.weight[...] = blk.gate.weight[...] * 20  # a router with real preferences
    x = np.asarray(jax.random.normal(jax.random.key(1), (7, 16)), np.float64)
    _, own = route_top_k(blk.gate(jnp.asarray(x, jnp.float32)), 2, norm)
    ids = (np.asarray(own) + np.array([1, 0])) % 6  # recorded experts that differ from the router's own choice
    ids[:, 1] = np.where(ids[:, 1] == ids[:, 0], (ids[:, 0] + 3) % 6, ids[:, 1])
    c = np.asarray(jax.random.normal(jax.random.key(2), (7, 16)), np.float64)

    def loss(m):
        out, _ = m.forward(jnp.asarray(x, jnp.float32), jnp.asarray(ids, jnp.int32))
        return jnp.sum(out * jnp.asarray(c, jnp.float32))

    grads = nnx.grad(loss)(blk)
    g_jax = np.asarray(grads.gate.weight[...], np.float64)
    assert np.abs(g_jax).max() > 1e-5  # the router learns under replay
    wg = np.asarray(blk.experts.gate_proj.weight[...], np.float64)  # [E, I, H] stacks
    wu = np.asarray(blk.experts.up_proj.weight[...], np.float64)
    wd = np.asarray(blk.experts.down_proj.weight[...], np.float64)
    gate = np.asarray(blk.gate.weight[...], np.float64)
    ref_out = _np_block(x, gate, wg, wu, wd, ids, norm)
    out32 = np.asarray(blk.forward(jnp.asarray(x, jnp.float32), jnp.asarray(ids, jnp.int32))[0], np.float64)
    np.testing.assert_allclose(out32, ref_out, rtol=1e-4, atol=1e-5)
    fd = np.zeros_like(gate)
    eps = 1e-6
    for i in range(gate.shape[0]):
        for j in range(gate.shape[1]):
            gp, gm = gate.copy(), gate.copy()
            gp[i, j] += eps
            gm[i, j] -= eps
            fd[i, j] = ((_np_block(x, gp, wg, wu, wd, ids, norm) * c).sum()
                        - (_np_block(x, gm, wg, wu, wd, ids, norm) * c).sum()) / (2 * eps)
    np.testing.assert_allclose(g_jax, fd, rtol=2e-3, atol=2e-5 * np.abs(fd).max())


def test_model_router_gets_gradient_under_replay(moe8):
    cfg, model, _ = moe8
    rb = _rollout(cfg, model, max_tokens=4)
    pid, pmask, rid, routed = _batch(rb)
    m = jnp.asarray(rb.response_mask)
    # jitted: the same gradient as one program (op by op, the backward of the whole model took ~20 s)
    grads = nnx.jit(nnx.grad(lambda mdl: jnp.sum(response_logprobs(mdl, pid, pmask, rid, 1.0, routed) * m)))(model)
    for i in range(cfg.num_hidden_layers):
        assert np.abs(np.asarray(grads.model.layers[i].mlp.gate.weight[...])).max() > 0


# -- dense models: replay changes nothing ----------------------------------------------------------------------


def test_dense_model_replay_is_a_no_op_bit_identical():
    from fp8rl_jax.models.config import ModelConfig

    cfg = ModelConfig(model_type="qwen3", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      eos_token_id=3, pad_token_id=0, qk_norm=True)
    model = build_model(cfg, seed=0)
    pid, pmask = left_pad([[5, 6, 7], [8, 9]], 0, bucket=8)
    rid = jnp.asarray([[4, 5, 6], [7, 8, 9]], jnp.int32)
    junk = jnp.zeros((2, pid.shape[1] + 3, 2, 2), jnp.int32)

    def loss(mdl, routed):
        return jnp.sum(response_logprobs(mdl, jnp.asarray(pid), jnp.asarray(pmask), rid, 1.0, routed))

    l0, g0 = nnx.value_and_grad(loss)(model, None)
    l1, g1 = nnx.value_and_grad(loss)(model, junk)
    assert np.array_equal(np.asarray(l0), np.asarray(l1))
    for a, b in zip(jax.tree.leaves(nnx.state(g0)), jax.tree.leaves(nnx.state(g1))):
        assert np.array_equal(np.asarray(a), np.asarray(b))


# -- the trainer: metric, replay, errors, gin ---------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_qwen3_moe_r3"))
    write_tiny_qwen3_moe(path, num_experts=8)
    return path


def _trainer(model_dir, **kw):
    from fp8rl_jax.trainer import TrainConfig
    from fp8rl_jax.trainer.loop import RLTrainer

    cfg = TrainConfig(output_dir="/dev/null", model=model_dir, num_steps=2, prompts_per_step=2, samples_per_prompt=2,
                      max_tokens=4, rollout_precision="fp8", learning_rate=1e-2, progress_bar=False,
                      verify_sync="first", **kw)
    tr = RLTrainer(cfg)
    tr.reward_fn = lambda text, item: float(len(text)) / 16  # non-constant rewards: real gradients
    return tr


def test_trainer_moe_metric_replay_and_missing_record_error(tiny_moe_dir):
    tr = _trainer(tiny_moe_dir, routing_replay=True)
    m = tr.step()
    assert 0.0 <= m["rollout_corr/routing_mismatch"] <= 1.0 and np.isfinite(m["actor/loss"])

    class NoRouting:  # an engine that returns no routing record (e.g. vLLM without return_routed_experts)
        def __init__(self, inner):
            self.inner = inner

        def generate(self, *a, **k):
            return dataclasses.replace(self.inner.generate(*a, **k), routed_experts=None, prompt_routed_experts=None)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    tr.engine = NoRouting(tr.engine)
    with pytest.raises(RuntimeError, match="routing_replay=True"):
        tr.step()
    # replay off: the same engine is fine, and no record means no metric
    tr.cfg = dataclasses.replace(tr.cfg, routing_replay=False)
    tr._train_step = tr._build_train_step()
    assert "rollout_corr/routing_mismatch" not in tr.step()


def test_trainer_dense_step_bit_identical_with_replay(tmp_path):
    from conftest import make_tiny_run_dir

    d = make_tiny_run_dir(tmp_path / "dense", arch="qwen3")
    runs = []
    for replay in (False, True):
        tr = _trainer(d, routing_replay=replay)
        m = tr.step()
        runs.append((m, {k: np.asarray(v) for k, v in named_params(tr.model).items()}))
    (m0, p0), (m1, p1) = runs
    assert "rollout_corr/routing_mismatch" not in m0
    for key in ("actor/loss", "actor/grad_norm", "rollout_corr/k3_kl"):
        assert m0[key] == m1[key], key
    assert all(np.array_equal(p0[k], p1[k]) for k in p0)


def test_gin_binding():
    import gin

    from fp8rl_jax.trainer import TrainConfig

    assert TrainConfig().routing_replay is False
    with gin.unlock_config():
        gin.parse_config("train.routing_replay = True")
    try:
        assert TrainConfig().routing_replay is True
    finally:
        gin.clear_config()
    with pytest.raises(TypeError, match="train.routing_replay='yes' is a str; expected bool"):
        TrainConfig(routing_replay="yes")  # the generic field-type check names the binding
