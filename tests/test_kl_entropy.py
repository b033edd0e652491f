"""KL to a reference policy and the entropy bonus (issue 39 item 11), verl semantics.

References: float64 numpy transcriptions, written here from verl's formulas (verl/trainer/ppo/core_algos.py
``kl_penalty`` / ``kl_penalty_forward``, verl/utils/torch_functional.py ``entropy_from_logits``, verl's actor loss
``pg_loss - entropy_coeff * agg(entropy) + kl_loss_coef * agg(kl)``) with hand-derived gradients; a tiny training run
(the reference equals the policy before the first update, so the KL of step 1 is 0); a resumed run (the reference
is rebuilt from the initial weights, not from the checkpoint).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8rl_jax.objectives import KL_LOSS_TYPES, LossConfig, RolloutCorrectionConfig, compute_policy_loss
from fp8rl_jax.objectives.kl_entropy import entropy_from_logits, kl_penalty
from fp8rl_jax.objectives.policy_loss import agg_loss
from fp8rl_jax.trainer.logprobs import token_logprobs


# ---------------------------------------------------------------------------------------------------------------
# float64 references
# ---------------------------------------------------------------------------------------------------------------
def np_kl(lp, ref, kl_type):
    """verl's per-token estimate (value) and its derivative w.r.t. ``lp``, float64."""
    lp, ref = np.asarray(lp, np.float64), np.asarray(ref, np.float64)
    d = lp - ref
    base = kl_type[:-1] if kl_type.endswith("+") else kl_type
    if base in ("k1", "kl"):
        v, g = d, np.ones_like(d)
    elif base == "abs":
        v, g = np.abs(d), np.sign(d)
    elif base in ("k2", "mse"):
        v, g = d * d / 2, d
    else:  # k3 / low_var_kl: x = ref - lp clamped to [-20, 20]; exp(x) - x - 1 clamped to [-10, 10]
        x = ref - lp
        xc = np.minimum(np.maximum(x, -20.0), 20.0)
        raw = np.exp(xc) - xc - 1
        v = np.minimum(np.maximum(raw, -10.0), 10.0)
        g = -(np.exp(xc) - 1) * (np.abs(x) < 20) * (raw < 10)  # d/dlp; zero where a clamp is active
    if kl_type.endswith("+"):
        g = d  # straight-through: k2's gradient
    return v, g


def np_entropy(z):
    """Entropy of softmax(z) over the last axis and dH/dz, float64: H = -sum p log p, dH/dz = -p (log p + H)."""
    z = np.asarray(z, np.float64)
    z = z - z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    p = np.exp(logp)
    h = -(p * logp).sum(-1)
    return h, -p * (logp + h[..., None])


def _log_ratios():
    """Log-ratios d = lp - ref covering each branch: small, moderate, k3's value clamp (ref - lp > ~2.6 gives
    exp(x) - x - 1 > 10) and its exp clamp (|ref - lp| > 20); no value sits on a clamp boundary."""
    d = np.array([[-0.3, 0.05, 0.7, -1.9, 2.4, -3.5],
                  [-25.0, 22.0, 1e-3, -1e-3, 4.0, -0.8]])
    ref = np.array([[-1.2, -0.4, -2.0, -0.9, -3.1, -0.2],
                    [-0.7, -30.0, -1.5, -2.5, -6.0, -0.05]])
    return (ref + d).astype(np.float32), ref.astype(np.float32)


@pytest.mark.parametrize("kl_type", KL_LOSS_TYPES)
def test_kl_penalty_values_and_gradients_match_verl_float64(kl_type):
    lp, ref = _log_ratios()
    w = np.random.default_rng(1).normal(size=lp.shape)
    v_ref, g_ref = np_kl(lp, ref, kl_type)
    v = kl_penalty(jnp.asarray(lp), jnp.asarray(ref), kl_type)
    g = jax.grad(lambda x: jnp.sum(kl_penalty(x, jnp.asarray(ref), kl_type) * w.astype(np.float32)))(jnp.asarray(lp))
    assert v.dtype == jnp.float32 and v.shape == lp.shape
    np.testing.assert_allclose(np.asarray(v), v_ref, rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(np.asarray(g), w * g_ref, rtol=2e-5, atol=2e-6)
    if kl_type.rstrip("+") in ("k3", "low_var_kl"):  # the clamps are exercised: 10 reached, and not everywhere
        assert np.isclose(v_ref, 10.0).any() and (v_ref < 10).any()


@pytest.mark.parametrize("base", ["k1", "k3", "low_var_kl", "abs"])
def test_plus_variants_keep_the_value_and_take_k2s_gradient(base):
    """'+' changes the gradient only (verl: straight-through to k2); for k1 the gradient changes from 1 to d."""
    lp, ref = _log_ratios()
    plain = kl_penalty(jnp.asarray(lp), jnp.asarray(ref), base)
    plus = kl_penalty(jnp.asarray(lp), jnp.asarray(ref), base + "+")
    np.testing.assert_array_equal(np.asarray(plain), np.asarray(plus))
    g_plain = np.asarray(jax.grad(lambda x: jnp.sum(kl_penalty(x, jnp.asarray(ref), base)))(jnp.asarray(lp)))
    g_plus = np.asarray(jax.grad(lambda x: jnp.sum(kl_penalty(x, jnp.asarray(ref), base + "+")))(jnp.asarray(lp)))
    np.testing.assert_allclose(g_plus, lp.astype(np.float64) - ref, rtol=1e-6, atol=1e-6)
    assert np.abs(g_plus - g_plain).max() > 0.1


def test_kl_penalty_padding_is_zero_with_zero_gradient_and_bad_type_is_named():
    lp, ref = _log_ratios()
    lp[0, -2:] = -np.inf  # padding may hold anything
    mask = np.ones(lp.shape, bool)
    mask[0, -2:] = False
    for t in ("k1", "k3", "k3+", "abs"):
        v = kl_penalty(jnp.asarray(lp), jnp.asarray(ref), t, jnp.asarray(mask))
        g = jax.grad(lambda x: jnp.sum(kl_penalty(x, jnp.asarray(ref), t, jnp.asarray(mask))))(jnp.asarray(lp))
        assert np.all(np.isfinite(v)) and np.all(np.isfinite(g)), t
        assert np.all(np.asarray(v)[0, -2:] == 0) and np.all(np.asarray(g)[0, -2:] == 0), t
    with pytest.raises(ValueError, match="kl_loss_type='k4'"):
        kl_penalty(jnp.asarray(lp), jnp.asarray(ref), "k4")


def test_entropy_from_logits_value_and_gradient_match_float64():
    z = np.random.default_rng(2).normal(size=(3, 5, 40)).astype(np.float32) * 3
    h_ref, dh_ref = np_entropy(z)
    w = np.random.default_rng(3).normal(size=(3, 5))
    h = entropy_from_logits(jnp.asarray(z))
    g = jax.grad(lambda x: jnp.sum(entropy_from_logits(x) * w.astype(np.float32)))(jnp.asarray(z))
    np.testing.assert_allclose(np.asarray(h), h_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(g), w[..., None] * dh_ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("chunk_size", [None, 7])
def test_chunked_entropy_carries_its_gradient(chunk_size):
    """token_logprobs(entropy_grad=True): the entropy of the temperature-scaled logits of every chunk, with the
    gradient of sum(w * H) w.r.t. the hidden states and the head weight equal to the float64 closed form."""
    rng = np.random.default_rng(4)
    b, t, d, v, temp = 2, 6, 8, 30, 0.8
    h = rng.normal(size=(b, t, d)).astype(np.float32)
    wt = (rng.normal(size=(v, d)) * 0.5).astype(np.float32)
    y = rng.integers(0, v, (b, t))
    w = rng.normal(size=(b, t))
    z = np.einsum("btd,vd->btv", h.astype(np.float64), wt.astype(np.float64)) / temp
    ent_ref, dz = np_entropy(z)
    dz = w[..., None] * dz / temp
    dw_ref, dh_ref = np.einsum("btv,btd->vd", dz, h), np.einsum("btv,vd->btd", dz, wt)

    def f(w_, h_):
        _, ent = token_logprobs(lambda x: x @ w_.T, h_, jnp.asarray(y), temp, chunk_size=chunk_size,
                                with_entropy=True, entropy_grad=True)
        return jnp.sum(ent * w.astype(np.float32)), ent

    (_, ent), (dw, dh) = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(wt, h)
    np.testing.assert_allclose(np.asarray(ent), ent_ref, atol=2e-5)
    np.testing.assert_allclose(np.asarray(dw), dw_ref, atol=2e-4)
    np.testing.assert_allclose(np.asarray(dh), dh_ref, atol=2e-4)


# ---------------------------------------------------------------------------------------------------------------
# the loss: pg - entropy_coeff * agg(H) + kl_loss_coef * agg(kl), agg = the policy loss's mode and mask
# ---------------------------------------------------------------------------------------------------------------
def _np_agg(x, m, mode):
    x, m = np.asarray(x, np.float64), np.asarray(m, np.float64)
    if mode == "token-mean":
        return (x * m).sum() / m.sum()
    n = m.sum(-1)
    rows = n > 0
    if mode == "seq-mean-token-mean":
        return ((x * m).sum(-1)[rows] / n[rows]).mean()
    return (x * m).sum(-1)[rows].mean()  # seq-mean-token-sum


@pytest.mark.parametrize("mode,kl_type", [("token-mean", "low_var_kl"), ("seq-mean-token-mean", "k1+"),
                                          ("seq-mean-token-sum", "k2")])
def test_compute_policy_loss_adds_the_terms_like_verl(mode, kl_type):
    rng = np.random.default_rng(5)
    b, t = 4, 6
    lp = (rng.normal(size=(b, t)) * 0.5 - 1.5).astype(np.float32)
    ref = (lp + rng.normal(size=(b, t)) * 0.3).astype(np.float32)
    old = (lp + rng.normal(size=(b, t)) * 0.05).astype(np.float32)
    ent = rng.uniform(0.5, 3.0, size=(b, t)).astype(np.float32)
    mask = np.ones((b, t), np.float32)
    mask[1, 4:] = 0
    mask[3, :] = 0  # an empty row
    adv = rng.normal(size=b).astype(np.float32)
    rc = RolloutCorrectionConfig(rollout_is=None)
    base = LossConfig(loss_agg_mode=mode, rollout_correction=rc, compute_metrics=False)
    full = LossConfig(loss_agg_mode=mode, rollout_correction=rc, compute_metrics=False, use_kl_loss=True,
                      kl_loss_type=kl_type, kl_loss_coef=0.3, entropy_coeff=0.02)
    args = (jnp.asarray(lp), jnp.asarray(old), None, jnp.asarray(adv), jnp.asarray(mask))

    def f_full(x):
        return compute_policy_loss(x, *args[1:], full, ref_logprobs=jnp.asarray(ref), entropy=jnp.asarray(ent))

    def f_pg(x):
        return compute_policy_loss(x, *args[1:], base)

    pg, m0 = jax.jit(f_pg)(args[0])
    loss, m1 = jax.jit(f_full)(args[0])
    kl_ref = _np_agg(np_kl(lp, ref, kl_type)[0], mask, mode)
    ent_ref = _np_agg(ent, mask, mode)
    np.testing.assert_allclose(float(m1["actor/kl_loss"]), kl_ref, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(float(m1["actor/entropy"]), ent_ref, rtol=1e-5)
    np.testing.assert_allclose(float(m1["actor/pg_loss"]), float(m0["actor/pg_loss"]), rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(float(loss), float(pg) - 0.02 * ent_ref + 0.3 * kl_ref, rtol=1e-5, atol=1e-7)
    assert float(m1["actor/kl_coef"]) == pytest.approx(0.3)
    # the KL term's gradient w.r.t. the log-probs is kl_loss_coef * agg of the estimator's derivative
    g_full = jax.jit(jax.grad(lambda x: f_full(x)[0]))(args[0])
    g_pg = jax.jit(jax.grad(lambda x: f_pg(x)[0]))(args[0])
    dk = np_kl(lp, ref, kl_type)[1]
    g_ref = np.zeros_like(dk)
    for i in range(b):  # the aggregation is linear: token (i, j)'s weight is agg of the one-hot matrix
        for j in range(t):
            onehot = np.zeros_like(dk)
            onehot[i, j] = 1.0
            g_ref[i, j] = 0.3 * _np_agg(onehot, mask, mode) * dk[i, j]
    np.testing.assert_allclose(np.asarray(g_full) - np.asarray(g_pg), g_ref, rtol=1e-4, atol=1e-6)


def test_missing_inputs_and_bad_bindings_are_one_line_errors():
    x = jnp.zeros((2, 3))
    with pytest.raises(ValueError, match="use_kl_loss=True needs ref_logprobs"):
        compute_policy_loss(x, x, x, jnp.zeros(2), jnp.ones((2, 3)), LossConfig(use_kl_loss=True))
    with pytest.raises(ValueError, match="entropy_coeff=0.01 needs the per-token entropy"):
        compute_policy_loss(x, x, x, jnp.zeros(2), jnp.ones((2, 3)), LossConfig(entropy_coeff=0.01))
    with pytest.raises(ValueError) as e:
        LossConfig(kl_loss_type="k4")
    assert "LossConfig.kl_loss_type='k4' is not one of" in str(e.value).splitlines()[0]  # gin appends "In call to"
    # the same through the command line's gin parsing: one line naming the binding
    from fp8rl_jax.trainer.cli import config_from_gin_flags

    import gin

    try:
        cfg, err = config_from_gin_flags(argparse.Namespace(gin_file=[], gin_param=["LossConfig.kl_loss_type='k4'"],
                                                            output_dir=None))
    finally:
        gin.clear_config()
    assert cfg is None and "\n" not in err and "LossConfig.kl_loss_type='k4'" in err, err


# ---------------------------------------------------------------------------------------------------------------
# the reference policy and a tiny training run
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def kl_run(tmp_path_factory):
    """Two steps with the KL and entropy terms (reference offloaded), a checkpoint after step 1."""
    from conftest import make_tiny_run_dir
    from fp8rl_jax.data.types import ListDataset, PromptItem
    from fp8rl_jax.trainer import RLTrainer, TrainConfig
    from fp8rl_jax.trainer.checkpoint import CheckpointStore

    root = tmp_path_factory.mktemp("kl_run")
    tiny = make_tiny_run_dir(root / "tiny")
    data = ListDataset([PromptItem(messages=[{"role": "user", "content": f"{a}+{b}="}], answer=str(a + b),
                                   task="toy") for a in range(10) for b in range(10)], name="toy")
    lc = LossConfig(use_kl_loss=True, kl_loss_type="low_var_kl", kl_loss_coef=0.1, entropy_coeff=0.01)

    def trainer():
        cfg = TrainConfig(output_dir=str(root / "out"), model=tiny, num_steps=2, prompts_per_step=2,
                          samples_per_prompt=4, max_tokens=6, rollout_precision="float32", learning_rate=3e-2,
                          progress_bar=False, plots=False, ref_offload=True, verify_sync="off")
        tr = RLTrainer(cfg, loss_config=lc, dataset=data)
        tr.reward_fn = lambda text, item: float(sum(text.encode()) % 3 == 0)
        return tr

    tr = trainer()
    store = CheckpointStore(str(root / "ckpt"), async_save=False)
    m1 = tr.step()
    tr.save_checkpoint(store, force=True)
    m2 = tr.step()
    return trainer, store, tr, [m1, m2]


def test_kl_is_zero_before_the_first_update_and_positive_after(kl_run):
    from flax import nnx

    from fp8rl_jax.trainer.offload import state_memory_kinds

    _, _, tr, (m1, m2) = kl_run
    assert m1["actor/grad_norm"] > 0
    assert abs(m1["actor/kl_loss"]) < 1e-7  # policy == reference: low_var_kl of identical log-probs
    assert m2["actor/kl_loss"] > 1e-5
    for m in (m1, m2):
        assert 0 < m["actor/entropy"] < np.log(320) + 1e-3  # nats, at most log(vocab)
        assert m["actor/kl_coef"] == pytest.approx(0.1)
        assert "timing/ref_logprobs_s" in m
        # the logged loss is the sum of the terms (on-policy, one update: actor/loss is that update's)
        assert m["actor/loss"] == pytest.approx(m["actor/pg_loss"] - 0.01 * m["actor/entropy"]
                                                + 0.1 * m["actor/kl_loss"], abs=1e-6)
    assert state_memory_kinds(tr.reference.model) == {"pinned_host"}
    # the reference kept the initial weights while the policy moved
    p = nnx.state(tr.model, nnx.Param)
    r = nnx.state(tr.reference.model, nnx.Param)
    diff = [float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(r))]
    assert max(diff) > 0


def test_resume_rebuilds_the_reference_from_the_initial_weights(kl_run):
    """A new trainer restored from step 1 trains step 2 with the same KL as the uninterrupted run (a reference built
    from the restored parameters would give KL 0 there)."""
    trainer, store, _, (_, m2) = kl_run
    tr = trainer()
    assert tr.restore_checkpoint(store, 1) == 1
    m = tr.step()
    assert m["actor/kl_loss"] == pytest.approx(m2["actor/kl_loss"], rel=1e-5, abs=1e-9)
    assert m["actor/entropy"] == pytest.approx(m2["actor/entropy"], rel=1e-5)


def test_fp8_reference_is_quantized_close_and_offloadable(kl_run):
    """ref_precision='fp8': the FP8 engine's W8A8 weights (e4m3 linears) of a policy, log-probs within the quantization
    error of the float policy's; offload keeps its parameters in pinned_host between uses; a 'train' copy computes
    exactly the trainer's log-probs."""
    from flax import nnx

    from fp8rl_jax.trainer.offload import state_memory_kinds
    from fp8rl_jax.trainer.reference import ReferencePolicy

    _, _, tr, _ = kl_run
    rng = np.random.default_rng(0)
    pid = jnp.asarray(rng.integers(3, 300, (2, 8)), jnp.int32)
    pmask = jnp.ones((2, 8), bool)
    rid = jnp.asarray(rng.integers(3, 300, (2, 6)), jnp.int32)
    want = np.asarray(tr._logprobs(tr.model, pid, pmask, rid, 1.0))  # the trainer's old_logprobs forward
    ref = ReferencePolicy(tr.model, precision="fp8", offload=True, model_config=tr.model_config)
    dtypes = {str(x.dtype) for x in jax.tree.leaves(nnx.state(ref.model, nnx.Param))}
    assert "float8_e4m3fn" in dtypes and state_memory_kinds(ref.model) == {"pinned_host"}
    got = np.asarray(ref.logprobs(tr._logprobs, pid, pmask, rid, 1.0))
    assert state_memory_kinds(ref.model) == {"pinned_host"}
    err = np.abs(got - want)
    assert 0 < err.max() < 0.3 and err.mean() < 0.05, err
    train_copy = ReferencePolicy(tr.model, precision="train")
    np.testing.assert_array_equal(np.asarray(train_copy.logprobs(tr._logprobs, pid, pmask, rid, 1.0)), want)
    assert ref.bytes < train_copy.bytes / 2
    with pytest.raises(ValueError, match="train.ref_precision='bf8'"):
        ReferencePolicy(tr.model, precision="bf8")


def test_micro_batches_with_kl_and_entropy_equal_the_whole_minibatch():
    """train.micro_batch_size with the KL and entropy terms (and a rejection that drops rows from the aggregation
    mask): the accumulated gradient, loss and metrics equal the whole minibatch's (train_step's decomposition)."""
    from flax import nnx
    from test_mesh import grads_dict, max_err

    from fp8rl_jax.models.config import ModelConfig
    from fp8rl_jax.models.loading import build_model
    from fp8rl_jax.trainer.loop import _response_logprobs_uncaptured
    from fp8rl_jax.trainer.train_step import StepOptions, loss_and_grads

    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, eos_token_id=2, pad_token_id=0)
    model = build_model(cfg, None, seed=1)
    rng = np.random.default_rng(1)
    rows, p, t = 8, 6, 6
    plen, rlen = rng.integers(2, p + 1, rows), rng.integers(1, t + 1, rows)
    rlen[3] = 0  # an empty response
    pmask = np.arange(p)[None, :] >= (p - plen)[:, None]
    batch = {"prompt_ids": jnp.asarray(np.where(pmask, rng.integers(3, 64, (rows, p)), 0), jnp.int32),
             "prompt_mask": jnp.asarray(pmask), "response_ids": jnp.asarray(rng.integers(3, 64, (rows, t)), jnp.int32),
             "response_mask": jnp.asarray(np.arange(t)[None, :] < rlen[:, None], jnp.int32),
             "advantages": jnp.asarray(rng.normal(size=rows), jnp.float32)}
    lp = np.asarray(nnx.jit(_response_logprobs_uncaptured)(model, batch["prompt_ids"], batch["prompt_mask"],
                                                            batch["response_ids"], 1.0))
    sd = np.where(np.arange(rows) % 2 == 0, 0.02, 0.4)[:, None]  # odd rows far from the policy: rejected
    batch["rollout_logprobs"] = jnp.asarray(lp + rng.normal(size=lp.shape) * sd, jnp.float32)
    batch["ref_logprobs"] = jnp.asarray(lp + rng.normal(size=lp.shape) * 0.2, jnp.float32)
    lc = LossConfig(loss_agg_mode="seq-mean-token-mean", use_kl_loss=True, kl_loss_type="k3+", kl_loss_coef=0.5,
                    entropy_coeff=0.05, rollout_correction=RolloutCorrectionConfig(
                        rollout_is="sequence", rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01))
    whole = nnx.jit(lambda m, b: loss_and_grads(m, b, StepOptions(lc, 1.0), True))(model, batch)
    micro = nnx.jit(lambda m, b: loss_and_grads(m, b, StepOptions(lc, 1.0, micro_batch_size=2), True))(model, batch)
    gw, gm = grads_dict(whole[0]), grads_dict(micro[0])
    assert max(float(np.abs(v).max()) for v in gw.values()) > 1e-4
    assert max_err(gm, gw) <= 1e-7
    np.testing.assert_allclose(float(micro[1]), float(whole[1]), rtol=2e-5, atol=1e-6)
    assert {"actor/kl_loss", "actor/entropy", "actor/kl_coef"} <= set(whole[2]) and sorted(micro[2]) == sorted(whole[2])
    for k in ("actor/kl_loss", "actor/entropy", "actor/pg_loss"):
        np.testing.assert_allclose(float(micro[2][k]), float(whole[2][k]), rtol=1e-5, atol=1e-6, err_msg=k)
    assert 0.0 < float(whole[2]["rollout_corr/rollout_rs_masked_fraction"]) < 1.0
    assert float(whole[2]["actor/kl_loss"]) > 0
