"""Policy losses beyond PPO (GSPO, REINFORCE), both verl regimes through compute_policy_loss, presets and
gin bindings. References are float64 numpy implementations written here from the published formulas."""

from __future__ import annotations

import math

import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8rl_jax.objectives import (
    PRESETS,
    LossConfig,
    RolloutCorrectionConfig,
    chain,
    compute_policy_loss,
    gspo_loss,
    ImportanceSampling,
    RejectionSampling,
    reinforce_loss,
    rollout_correction_preset,
)


def make(seed, B=8, T=6, scale=0.3, extreme=False):
    rng = np.random.default_rng(seed)
    lens = rng.integers(0, T + 1, size=B)
    lens[0], lens[-1] = 0, T
    m = (np.arange(T)[None] < lens[:, None]).astype(np.float64)
    old = -rng.exponential(1.2, size=(B, T))
    lp = old + scale * rng.normal(size=(B, T))
    roll = old + scale * rng.normal(size=(B, T))
    if extreme:
        roll = np.where(rng.random((B, T)) < 0.2, old + rng.choice([-100.0, 100.0], size=(B, T)), roll)
        lp = np.where(rng.random((B, T)) < 0.2, old + rng.choice([-100.0, 100.0], size=(B, T)), lp)
    adv = rng.normal(size=B)
    return lp, old, roll, adv, m


def f32(*xs):
    return [jnp.asarray(x, jnp.float32) for x in xs]


def finite(tree):
    return all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree_util.tree_leaves(tree))


def rows(m):
    return [b for b in range(m.shape[0]) if m[b].sum() > 0]


def agg(L, m, mode):
    if mode == "token-mean":
        return (L * m).sum() / m.sum()
    if mode == "seq-mean-token-sum-norm":
        return (L * m).sum() / m.shape[1]
    per = [(L[b] * m[b]).sum() / (m[b].sum() if mode == "seq-mean-token-mean" else 1.0) for b in rows(m)]
    return float(np.mean(per))


def ref_ppo_mat(lp, old, adv, m, lo=0.2, hi=0.2, w=None):
    L = np.zeros(m.shape)
    for b in rows(m):
        for t in range(m.shape[1]):
            if m[b, t]:
                r = math.exp(min(max(lp[b, t] - old[b, t], -20), 20))
                L[b, t] = max(-adv[b] * r, -adv[b] * min(max(r, 1 - lo), 1 + hi)) * (1 if w is None else w[b, t])
    return L


def ref_token_w(target, roll, m, C, lo=None):
    w = np.zeros(m.shape)
    for b in rows(m):
        for t in range(m.shape[1]):
            if m[b, t]:
                x = min(math.exp(min(max(target[b, t] - roll[b, t], -20), 20)), C)
                w[b, t] = x if lo is None else max(x, lo)
    return w


def ref_seq_w(target, roll, m, C):
    w = np.zeros(m.shape)
    for b in rows(m):
        s = sum(target[b, t] - roll[b, t] for t in range(m.shape[1]) if m[b, t])
        w[b] = m[b] * min(math.exp(min(max(s, -20), 20)), C)
    return w


def ref_geo_keep(target, roll, m, lo, hi):
    """verl seq_mean_k1: keep iff log(lo) <= mean_t -(target - roll) <= log(hi)."""
    keep = np.zeros(m.shape)
    for b in rows(m):
        k1 = np.mean([-(min(max(target[b, t] - roll[b, t], -20), 20)) for t in range(m.shape[1]) if m[b, t]])
        keep[b] = m[b] * float(math.log(lo) <= k1 <= math.log(hi))
    return keep


def ref_k3_keep(target, roll, m, thr):
    keep = np.zeros(m.shape)
    for b in rows(m):
        rs = [min(max(target[b, t] - roll[b, t], -20), 20) for t in range(m.shape[1]) if m[b, t]]
        keep[b] = m[b] * float(np.mean([math.exp(r) - 1 - r for r in rs]) <= thr)
    return keep


# ------------------------------------------------------------------------------------------------- GSPO


@pytest.mark.parametrize("extreme", [False, True])
@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "token-mean"])
def test_gspo_matches_reference(extreme, mode):
    lp, old, roll, adv, m = make(3, scale=0.02 if not extreme else 0.3, extreme=extreme)
    lo, hi = 3e-4, 4e-4
    L = np.zeros(m.shape)
    G = np.zeros(m.shape)  # d loss_mat / d lp_bt (own token only: GSPO-token gradient)
    for b in rows(m):
        toks = [t for t in range(m.shape[1]) if m[b, t]]
        log_s = np.mean([lp[b, t] - old[b, t] for t in toks])
        s = math.exp(min(log_s, 10.0))  # verl clamps log s at 10 (no gradient above)
        for t in toks:
            l1, l2 = -adv[b] * s, -adv[b] * min(max(s, 1 - lo), 1 + hi)
            L[b, t] = max(l1, l2)
            G[b, t] = -adv[b] * s if (l1 >= l2 and log_s < 10.0) else 0.0
    loss, met = gspo_loss(*f32(lp, old, adv, m), lo, hi, loss_agg_mode=mode)
    np.testing.assert_allclose(float(loss), agg(L, m, mode), rtol=1e-4, atol=1e-5)
    g = jax.grad(lambda x: gspo_loss(x, *f32(old, adv, m), lo, hi, loss_agg_mode=mode)[0])(jnp.asarray(lp, jnp.float32))
    n = m.sum(1, keepdims=True)
    S = len(rows(m))
    g_ref = G * m / (m.sum() if mode == "token-mean" else np.where(n > 0, n, 1) * S)
    np.testing.assert_allclose(np.asarray(g), g_ref, rtol=1e-3, atol=1e-6)
    assert finite((loss, met, g))


# -------------------------------------------------------------------------------------------- REINFORCE


@pytest.mark.parametrize("mode", ["seq-mean-token-sum", "token-mean", "seq-mean-token-sum-norm"])
def test_reinforce_matches_reference(mode):
    lp, old, roll, adv, m = make(5, extreme=True)
    w = np.random.default_rng(0).uniform(0, 2, size=m.shape)
    loss, met = reinforce_loss(*f32(lp, roll, adv, m), token_weights=jnp.asarray(w, jnp.float32), loss_agg_mode=mode)
    L = -adv[:, None] * np.where(m > 0, lp, 0) * w
    np.testing.assert_allclose(float(loss), agg(L, m, mode), rtol=1e-4, atol=1e-4)
    kl = ((roll - lp) * m)[m > 0].mean()
    np.testing.assert_allclose(float(met["actor/ppo_kl"]), kl, rtol=1e-4)
    g = jax.grad(lambda x: reinforce_loss(x, *f32(roll, adv, m), token_weights=jnp.asarray(w, jnp.float32),
                                          loss_agg_mode=mode)[0])(jnp.asarray(lp, jnp.float32))
    if mode == "token-mean":
        np.testing.assert_allclose(np.asarray(g), -adv[:, None] * w * m / m.sum(), rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------------------------------------ regimes


@pytest.mark.parametrize("extreme", [False, True])
def test_regimes_match_reference(extreme):
    lp, old, roll, adv, m = make(7, extreme=extreme)
    a = f32(lp, old, roll, adv, m)

    # decoupled, seq TIS + K3-RS, clip-higher
    rc = RolloutCorrectionConfig.decoupled_k3_rs_seq_tis(2.0, 0.02)
    cfg = LossConfig(clip_ratio_high=0.28, rollout_correction=rc)
    loss, met = jax.jit(compute_policy_loss, static_argnums=5)(*a, cfg)
    keep = ref_k3_keep(old, roll, m, 0.02)
    L = ref_ppo_mat(lp, old, adv, m, 0.2, 0.28, ref_seq_w(old, roll, m, 2.0))
    ref = agg(L, keep, "token-mean") if keep.sum() else 0.0
    np.testing.assert_allclose(float(loss), ref, rtol=1e-4, atol=1e-5)
    assert finite((loss, met))

    # decoupled, token TIS with lower clamp "0.5_2.0" + geo RS, seq-mean-token-mean
    rc = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold="0.5_2.0", rollout_rs="seq_mean_k1",
                                 rollout_rs_threshold="0.8_1.25")
    loss, _ = compute_policy_loss(*a, LossConfig(loss_agg_mode="seq-mean-token-mean", rollout_correction=rc))
    keep = ref_geo_keep(old, roll, m, 0.8, 1.25)
    L = ref_ppo_mat(lp, old, adv, m, w=ref_token_w(old, roll, m, 2.0, 0.5))
    np.testing.assert_allclose(float(loss), agg(L, keep, "seq-mean-token-mean") if keep.sum() else 0.0,
                               rtol=1e-4, atol=1e-5)

    # bypass ppo_clip + geo RS: ratio pi/pi_rollout, RS on (pi, rollout), no IS weights
    loss, met = compute_policy_loss(a[0], None, *a[2:], RolloutCorrectionConfig.bypass_ppo_clip_geo_rs("0.8_1.25"))
    keep = ref_geo_keep(lp, roll, m, 0.8, 1.25)
    ref = agg(ref_ppo_mat(lp, roll, adv, m), keep, "token-mean") if keep.sum() else 0.0
    np.testing.assert_allclose(float(loss), ref, rtol=1e-4, atol=1e-5)
    assert finite((loss, met))

    # bypass reinforce + token TIS on sg(pi)/rollout
    rc = RolloutCorrectionConfig(rollout_is="token", bypass_mode=True, loss_type="reinforce")
    cfg = LossConfig(loss_agg_mode="token-mean", rollout_correction=rc)
    loss, _ = compute_policy_loss(*a, cfg)
    L = -adv[:, None] * np.where(m > 0, lp, 0) * ref_token_w(lp, roll, m, 2.0)
    np.testing.assert_allclose(float(loss), agg(L, m, "token-mean"), rtol=1e-4, atol=1e-4)
    # its gradient is the IS-weighted score function: the weights do not get differentiated
    g = jax.grad(lambda x: compute_policy_loss(x, *a[1:], cfg)[0])(a[0])
    np.testing.assert_allclose(np.asarray(g), -adv[:, None] * ref_token_w(lp, roll, m, 2.0) * m / m.sum(),
                               rtol=1e-4, atol=1e-7)

    # decoupled GSPO with token TIS
    loss, _ = compute_policy_loss(*a, LossConfig(loss_mode="gspo", clip_ratio_low=3e-4, clip_ratio_high=4e-4,
                                                 loss_agg_mode="seq-mean-token-mean"))
    ref, _ = gspo_loss(*f32(lp, old, adv, m), 3e-4, 4e-4, token_weights=jnp.asarray(ref_token_w(old, roll, m, 2.0)))
    np.testing.assert_allclose(float(loss), float(ref), rtol=1e-5, atol=1e-6)

    # custom transform replaces rollout_is/rollout_rs
    custom = chain(ImportanceSampling("token", "mask", 2.0), RejectionSampling("token_k2", 0.05))
    loss_c, met_c = compute_policy_loss(*a, LossConfig(transform=custom))
    assert "rollout_corr/rollout_is_masked_fraction" in met_c and finite((loss_c, met_c))


def test_gradients_wrt_old_and_rollout_are_zero_in_every_preset():
    lp, old, roll, adv, m = make(9, extreme=True)
    a = f32(lp, old, roll, adv, m)
    for name in PRESETS:
        cfg = LossConfig(rollout_correction=rollout_correction_preset(name))
        g_old, g_roll = jax.grad(lambda o, r: compute_policy_loss(a[0], o, r, a[3], a[4], cfg)[0], argnums=(0, 1))(
            a[1], a[2])
        if not cfg.rollout_correction.bypass_mode:
            assert float(jnp.abs(g_old).sum()) == 0.0, name
        if cfg.rollout_correction.loss_type == "reinforce" or not cfg.rollout_correction.bypass_mode:
            assert float(jnp.abs(g_roll).sum()) == 0.0, name
        loss, met = compute_policy_loss(*a, cfg)
        assert finite((loss, met)), name


def test_entirely_masked_batch_every_preset():
    lp, old, roll, adv, m = make(10, extreme=True)
    z = jnp.zeros(m.shape)
    for name in PRESETS:
        cfg = LossConfig(rollout_correction=rollout_correction_preset(name), loss_agg_mode="seq-mean-token-mean")
        loss, met = compute_policy_loss(*f32(lp, old, roll, adv), z, cfg)
        g = jax.grad(lambda x: compute_policy_loss(x, *f32(old, roll, adv), z, cfg)[0])(jnp.asarray(lp, jnp.float32))
        assert float(loss) == 0.0 and finite((loss, met, g)), name


def test_presets_mirror_verl():
    R = RolloutCorrectionConfig
    assert R.decoupled_token_is() == R(rollout_is="token", rollout_is_threshold=2.0)
    assert R.decoupled_seq_is_rs() == R(rollout_is="sequence", rollout_rs="seq_sum_k1", rollout_rs_threshold="0.5_2.0")
    assert R.decoupled_geo_rs() == R(rollout_is=None, rollout_rs="seq_mean_k1", rollout_rs_threshold="0.999_1.001")
    assert R.bypass_ppo_clip_k3_rs().rollout_rs == "seq_mean_k3" and R.bypass_ppo_clip_k3_rs().bypass_mode
    assert R.bypass_pg_is() == R(rollout_is="sequence", bypass_mode=True, loss_type="reinforce")
    assert R.disabled() == R(rollout_is=None)
    assert rollout_correction_preset("decoupled_k3_rs", rs_threshold=0.05).rollout_rs_threshold == 0.05
    with pytest.raises(ValueError, match="decoupled_token_is"):
        rollout_correction_preset("tis")


def test_config_validation():
    with pytest.raises(ValueError, match="'vanilla', 'gspo'"):
        LossConfig(loss_mode="ppo")
    with pytest.raises(ValueError, match="token-mean"):
        LossConfig(loss_agg_mode="mean")
    with pytest.raises(ValueError, match="'ppo_clip', 'reinforce'"):
        RolloutCorrectionConfig(loss_type="pg")
    with pytest.raises(ValueError, match="token_k1"):
        RolloutCorrectionConfig(rollout_rs="k3")
    with pytest.raises(ValueError, match="rollout_rs_threshold"):
        RolloutCorrectionConfig(rollout_rs="seq_mean_k3")
    with pytest.raises(ValueError, match="rollout_is_threshold"):
        RolloutCorrectionConfig(rollout_is_threshold="x")
    with pytest.raises(ValueError, match="old_logprobs"):
        compute_policy_loss(jnp.zeros((2, 3)), None, jnp.zeros((2, 3)), jnp.zeros(2), jnp.ones((2, 3)))
    with pytest.raises(ValueError, match="rollout_logprobs"):
        compute_policy_loss(jnp.zeros((2, 3)), jnp.zeros((2, 3)), None, jnp.zeros(2), jnp.ones((2, 3)))
    with pytest.raises(ValueError, match="rollout_logprobs"):
        compute_policy_loss(jnp.zeros((2, 3)), jnp.zeros((2, 3)), jnp.zeros((3, 3)), jnp.zeros(2), jnp.ones((2, 3)))
    cfg = LossConfig(rollout_correction=RolloutCorrectionConfig(rollout_is=None), compute_metrics=False)
    loss, met = compute_policy_loss(jnp.zeros((2, 3)), jnp.zeros((2, 3)), None, jnp.ones(2), jnp.ones((2, 3)), cfg)
    assert float(loss) == -1.0 and not any(k.startswith("rollout_corr/") for k in met)
    hash(LossConfig())  # usable as a jit static argument


def test_gin_switches_correction_in_one_line():
    try:
        gin.clear_config()
        gin.parse_config("RolloutCorrectionConfig.rollout_is = 'sequence'")
        assert LossConfig().rollout_correction.rollout_is == "sequence"
        gin.clear_config()
        gin.parse_config(
            "LossConfig.rollout_correction = @rollout_correction_preset()\n"
            "rollout_correction_preset.name = 'bypass_pg_geo_rs'\n"
            "LossConfig.loss_agg_mode = 'seq-mean-token-sum-norm'\n"
            "RolloutCorrectionConfig.rollout_is_threshold = '0.5_3.0'\n"
        )
        cfg = LossConfig()
        assert cfg.rollout_correction == RolloutCorrectionConfig.bypass_pg_geo_rs()
        assert cfg.loss_agg_mode == "seq-mean-token-sum-norm"
        gin.clear_config()
        gin.parse_config("fp8rl_jax.objectives.RolloutCorrectionConfig.rollout_rs = 'token_k3'\n"
                         "RolloutCorrectionConfig.rollout_rs_threshold = 0.02")
        assert LossConfig().rollout_correction.rollout_rs == "token_k3"
    finally:
        gin.clear_config()
    assert LossConfig().rollout_correction == RolloutCorrectionConfig()


def test_vmap_over_microbatches_and_jit():
    lp, old, roll, adv, m = make(12, extreme=True)
    a = f32(lp, old, roll, adv, m)
    stacked = [jnp.stack([x, x[::-1]]) for x in a]
    cfg = LossConfig(rollout_correction=RolloutCorrectionConfig.decoupled_geo_rs_token_tis(rs_threshold="0.5_2.0"))
    loss_v, met_v = jax.jit(jax.vmap(lambda *xs: compute_policy_loss(*xs, cfg)))(*stacked)
    loss_0, met_0 = compute_policy_loss(*a, cfg)
    np.testing.assert_allclose(float(loss_v[0]), float(loss_0), rtol=1e-6, atol=1e-7)
    assert set(met_v) == set(met_0) and finite((loss_v, met_v))
