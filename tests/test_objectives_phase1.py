"""Phase-1 objectives: advantages, agg_loss, PPO clip, token TIS, mismatch metrics, compute_policy_loss.

Every reference below is a float64 numpy implementation of the published formula written here,
independently of the library (loops over rows / groups, no shared helpers).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8rl_jax.objectives import (
    LossConfig,
    RolloutCorrectionConfig,
    agg_loss,
    compute_policy_loss,
    drgrpo_advantages,
    grpo_advantages,
    ppo_clip_loss,
    rloo_advantages,
    rollout_corr_metrics,
    token_tis,
)

RTOL = 2e-5
ATOL = 2e-5


def _ragged_mask(rng, B, T, contiguous=True):
    lens = rng.integers(0, T + 1, size=B)
    lens[0] = 0  # always one empty response
    lens[-1] = T
    m = (np.arange(T)[None, :] < lens[:, None]).astype(np.float64)
    if not contiguous:
        m = m * (rng.random((B, T)) < 0.8)
    return m


def _batch(seed, B=8, T=7, scale=0.5, extreme=False, contiguous=True):
    rng = np.random.default_rng(seed)
    mask = _ragged_mask(rng, B, T, contiguous)
    old = -rng.exponential(1.5, size=(B, T))
    lp = old + scale * rng.normal(size=(B, T))
    roll = old + scale * rng.normal(size=(B, T))
    if extreme:
        sel = rng.random((B, T)) < 0.3
        roll = np.where(sel, old + rng.choice([-100.0, 100.0], size=(B, T)), roll)
        sel = rng.random((B, T)) < 0.3
        lp = np.where(sel, old + rng.choice([-100.0, 100.0], size=(B, T)), lp)
    # padding holds garbage, even -inf: it must never leak
    lp = np.where(mask > 0, lp, -np.inf)
    old = np.where(mask > 0, old, np.nan)
    roll = np.where(mask > 0, roll, -np.inf)
    adv = rng.normal(size=(B,))
    return lp, old, roll, adv, mask


def _f32(*xs):
    return [jnp.asarray(x, jnp.float32) for x in xs]


def _finite(tree):
    return all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree_util.tree_leaves(tree))


# --------------------------------------------------------------------------------------------- references


def ref_agg(L, m, mode, factor=None):
    L = np.where(m > 0, L, 0.0)
    if mode == "token-mean":
        return float((L * m).sum() / m.sum()) if m.sum() > 0 else 0.0
    if mode == "seq-mean-token-sum-norm":
        return float((L * m).sum() / (factor if factor else m.shape[1]))
    vals = []
    for b in range(m.shape[0]):
        n = m[b].sum()
        if n == 0:
            continue
        s = (L[b] * m[b]).sum()
        vals.append(s / n if mode == "seq-mean-token-mean" else s)
    return float(np.mean(vals)) if vals else 0.0


def ref_ppo(lp, old, adv, m, lo, hi, c=None, w=None, mode="token-mean"):
    B, T = m.shape
    A = np.broadcast_to(adv[:, None], (B, T)) if adv.ndim == 1 else adv
    L = np.zeros((B, T))
    cf = np.zeros((B, T))
    cfl = np.zeros((B, T))
    kl = np.zeros((B, T))
    for b in range(B):
        for t in range(T):
            if m[b, t] == 0:
                continue
            d = min(max(lp[b, t] - old[b, t], -20.0), 20.0)
            r = math.exp(d)
            a = A[b, t]
            l1, l2 = -a * r, -a * min(max(r, 1 - lo), 1 + hi)
            v = max(l1, l2)
            cf[b, t] = float(l2 > l1)
            if c is not None and a < 0:
                cfl[b, t] = float(v > -a * c)
                v = min(v, -a * c)
            if w is not None:
                v *= w[b, t]
            L[b, t] = v
            kl[b, t] = -d
    n = m.sum()
    mean = (lambda x: float((x * m).sum() / n)) if n > 0 else (lambda x: 0.0)
    return ref_agg(L, m, mode), {
        "actor/pg_clipfrac": mean(cf),
        "actor/pg_clipfrac_lower": mean(cfl),
        "actor/ppo_kl": mean(kl),
    }


def ref_tis(old, roll, m, C):
    w = np.zeros_like(m)
    for b in range(m.shape[0]):
        for t in range(m.shape[1]):
            if m[b, t]:
                w[b, t] = min(math.exp(min(max(old[b, t] - roll[b, t], -20), 20)), C)
    return w


def ref_offpolicy(old, roll, m):
    toks = [(b, t) for b in range(m.shape[0]) for t in range(m.shape[1]) if m[b, t]]
    rows = [b for b in range(m.shape[0]) if m[b].sum() > 0]
    E = lambda x: math.exp(min(max(x, -20.0), 20.0))  # noqa: E731
    mt = lambda f: float(np.mean([f(b, t) for b, t in toks]))  # noqa: E731
    lp_o = {b: np.mean([old[b, t] for t in range(m.shape[1]) if m[b, t]]) for b in rows}
    lp_r = {b: np.mean([roll[b, t] for t in range(m.shape[1]) if m[b, t]]) for b in rows}
    diff = [lp_r[b] - lp_o[b] for b in rows]
    lsum = [sum(old[b, t] - roll[b, t] for t in range(m.shape[1]) if m[b, t]) for b in rows]
    return {
        "kl": mt(lambda b, t: roll[b, t] - old[b, t]),
        "k3_kl": mt(lambda b, t: E(old[b, t] - roll[b, t]) - (old[b, t] - roll[b, t]) - 1),
        "training_ppl": np.mean([E(-lp_o[b]) for b in rows]),
        "training_log_ppl": np.mean([-lp_o[b] for b in rows]),
        "rollout_ppl": np.mean([E(-lp_r[b]) for b in rows]),
        "rollout_log_ppl": np.mean([-lp_r[b] for b in rows]),
        "log_ppl_diff": np.mean(diff),
        "log_ppl_abs_diff": np.mean(np.abs(diff)),
        "log_ppl_diff_max": np.max(diff),
        "log_ppl_diff_min": np.min(diff),
        "ppl_ratio": np.mean([E(d) for d in diff]),
        "chi2_token": mt(lambda b, t: E(old[b, t] - roll[b, t]) ** 2) - 1,
        "chi2_seq": np.mean([math.exp(2 * min(max(s, -20), 20)) for s in lsum]) - 1,
        "token_mult_prob_error": mt(lambda b, t: E(abs(old[b, t] - roll[b, t]))),
    }


# ------------------------------------------------------------------------------------------- advantages


@pytest.mark.parametrize("n", [1, 2, 4])
def test_advantages_match_reference(n):
    rng = np.random.default_rng(n)
    r = rng.integers(0, 2, size=6 * n).astype(np.float64)
    r[:n] = 1.0  # a zero-variance group
    g_std, g_nostd, g_rloo = [], [], []
    for p in range(6):
        grp = r[p * n:(p + 1) * n]
        mean = grp.mean() if n > 1 else 0.0
        std = grp.std(ddof=1) if n > 1 else 1.0
        for x in grp:
            g_std.append((x - mean) / (std + 1e-6))
            g_nostd.append(x - mean)
            g_rloo.append(x - (grp.sum() - x) / (n - 1) if n > 1 else x)
    np.testing.assert_allclose(grpo_advantages(r, n), g_std, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grpo_advantages(r, n, norm_by_std=False), g_nostd, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(drgrpo_advantages(r, n), g_nostd, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(rloo_advantages(r, n), g_rloo, rtol=1e-5, atol=1e-5)
    assert grpo_advantages(r, n).dtype == jnp.float32
    assert _finite(jax.jit(grpo_advantages, static_argnums=1)(jnp.asarray(r), n))


def test_advantages_errors():
    with pytest.raises(ValueError, match="multiple of group_size"):
        grpo_advantages(jnp.zeros(5), 2)
    with pytest.raises(ValueError, match="group_size"):
        rloo_advantages(jnp.zeros(4), 0)
    with pytest.raises(ValueError, match=r"\[B\]"):
        grpo_advantages(jnp.zeros((2, 2)), 2)


# ------------------------------------------------------------------------------------------ aggregation


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("seed", [0, 1])
def test_agg_loss(mode, seed):
    rng = np.random.default_rng(seed)
    m = _ragged_mask(rng, 9, 6, contiguous=bool(seed))
    L = rng.normal(size=m.shape)
    L_pad = np.where(m > 0, L, np.nan)  # garbage in the padding must not leak
    got = agg_loss(jnp.asarray(L_pad, jnp.float32), jnp.asarray(m > 0), mode)
    np.testing.assert_allclose(float(got), ref_agg(L, m, mode), rtol=RTOL, atol=ATOL)
    got = agg_loss(jnp.asarray(L, jnp.float32), jnp.asarray(m), mode, loss_scale_factor=100.0)
    np.testing.assert_allclose(float(got), ref_agg(L, m, mode, 100.0), rtol=RTOL, atol=ATOL)
    # entirely masked batch -> 0, finite gradient
    z = jnp.zeros(m.shape)
    assert float(agg_loss(jnp.asarray(L, jnp.float32), z, mode)) == 0.0
    assert _finite(jax.grad(lambda x: agg_loss(x, z, mode))(jnp.asarray(L, jnp.float32)))


def test_agg_loss_errors():
    with pytest.raises(ValueError, match="token-mean"):
        agg_loss(jnp.zeros((2, 3)), jnp.ones((2, 3)), "token-sum")
    with pytest.raises(ValueError, match="response_mask"):
        agg_loss(jnp.zeros((2, 3)), jnp.ones((2, 4)), "token-mean")


# ----------------------------------------------------------------------------------------------- PPO clip


@pytest.mark.parametrize("extreme", [False, True])
@pytest.mark.parametrize(
    "lo,hi,c,mode",
    [
        (0.2, 0.2, None, "token-mean"),
        (0.2, 0.28, 3.0, "seq-mean-token-mean"),
        (0.1, 0.3, 2.0, "seq-mean-token-sum-norm"),
    ],
)
def test_ppo_clip_matches_reference(extreme, lo, hi, c, mode):
    lp, old, roll, adv, m = _batch(3, extreme=extreme, scale=0.4)
    w = np.random.default_rng(9).uniform(0, 2, size=m.shape)
    for weights, adv_in in [(None, adv), (w, np.broadcast_to(adv[:, None], m.shape) * 0.5)]:
        loss, met = ppo_clip_loss(*_f32(lp, old, adv_in, m), lo, hi, c,
                                  token_weights=None if weights is None else jnp.asarray(weights, jnp.float32),
                                  loss_agg_mode=mode)
        ref_loss, ref_met = ref_ppo(lp, old, adv_in, m, lo, hi, c, weights, mode)
        np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-4, atol=1e-4)
        for k, v in ref_met.items():
            np.testing.assert_allclose(float(met[k]), v, rtol=1e-4, atol=1e-4, err_msg=k)
        np.testing.assert_allclose(float(met["actor/pg_loss"]), ref_loss, rtol=1e-4, atol=1e-4)
        g = jax.grad(lambda x: ppo_clip_loss(x, *_f32(old, adv_in, m), lo, hi, c, loss_agg_mode=mode)[0])(
            jnp.asarray(lp, jnp.float32)
        )
        assert _finite((loss, met, g))
        assert float(jnp.max(jnp.abs(jnp.where(m > 0, 0.0, g)))) == 0.0  # padding gets no gradient


def test_ppo_grad_matches_finite_differences():
    rng = np.random.default_rng(5)
    B, T = 4, 6
    m = _ragged_mask(rng, B, T)
    old = -rng.exponential(1.0, size=(B, T))
    d = rng.uniform(-0.5, 0.5, size=(B, T))
    for bound in (math.log(0.8), math.log(1.28), math.log(1 / 3.0)):  # keep away from the kinks
        d = np.where(np.abs(d - bound) < 0.03, d + 0.06, d)
    lp = old + d
    adv = rng.normal(size=(B,))
    f = jax.jit(lambda x: ppo_clip_loss(x, *_f32(old, adv, m), 0.2, 0.28, 3.0)[0])
    g = np.asarray(jax.grad(f)(jnp.asarray(lp, jnp.float32)))
    h = 1e-2
    fd = np.zeros_like(lp)
    for b in range(B):
        for t in range(T):
            e = np.zeros_like(lp)
            e[b, t] = h
            up, dn = float(f(jnp.asarray(lp + e, jnp.float32))), float(f(jnp.asarray(lp - e, jnp.float32)))
            fd[b, t] = (up - dn) / (2 * h)
    np.testing.assert_allclose(g, fd, rtol=2e-2, atol=2e-4)
    assert np.abs(g).sum() > 0


def test_ppo_entirely_masked_batch_and_errors():
    lp, old, roll, adv, m = _batch(4, extreme=True)
    z = jnp.zeros(m.shape)
    loss, met = ppo_clip_loss(*_f32(lp, old, adv), z, clip_ratio_c=3.0)
    g = jax.grad(lambda x: ppo_clip_loss(x, *_f32(old, adv), z)[0])(jnp.asarray(lp, jnp.float32))
    assert float(loss) == 0.0 and _finite((loss, met, g)) and float(jnp.abs(g).sum()) == 0.0
    with pytest.raises(ValueError, match="old_logprobs"):
        ppo_clip_loss(jnp.zeros((2, 3)), jnp.zeros((2, 4)), jnp.zeros(2), jnp.ones((2, 3)))
    with pytest.raises(ValueError, match="advantages"):
        ppo_clip_loss(jnp.zeros((2, 3)), jnp.zeros((2, 3)), jnp.zeros(3), jnp.ones((2, 3)))
    with pytest.raises(ValueError, match="clip_ratio_c"):
        ppo_clip_loss(jnp.zeros((2, 3)), jnp.zeros((2, 3)), jnp.zeros(2), jnp.ones((2, 3)), clip_ratio_c=0.5)
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        ppo_clip_loss(jnp.zeros((2, 3)), jnp.zeros((2, 3)), jnp.zeros(2), jnp.ones((2, 3)), loss_agg_mode="x")


# ------------------------------------------------------------------------------------------------- TIS


@pytest.mark.parametrize("extreme", [False, True])
@pytest.mark.parametrize("C", [2.0, 1.5])
def test_token_tis(extreme, C):
    lp, old, roll, adv, m = _batch(6, extreme=extreme, scale=0.6, contiguous=not extreme)
    w, met = jax.jit(token_tis, static_argnums=3)(*_f32(old, roll, m), C)
    np.testing.assert_allclose(np.asarray(w), ref_tis(old, roll, m, C), rtol=1e-5, atol=1e-6)
    assert _finite((w, met)) and float(jnp.min(w)) >= 0.0
    assert float(jnp.abs(jnp.where(m > 0, 0.0, w)).sum()) == 0.0
    raw = np.where(m > 0, np.exp(np.clip(np.nan_to_num(old - roll), -20, 20)), 0.0)
    sel = m > 0
    np.testing.assert_allclose(float(met["rollout_corr/rollout_is_mean"]), raw[sel].mean(), rtol=1e-5)
    np.testing.assert_allclose(float(met["rollout_corr/rollout_is_max"]), raw[sel].max(), rtol=1e-5)
    hi_frac, lo_frac = (raw[sel] > C).mean(), (raw[sel] < 1 / C).mean()
    np.testing.assert_allclose(float(met["rollout_corr/rollout_is_ratio_fraction_high"]), hi_frac, atol=1e-6)
    np.testing.assert_allclose(float(met["rollout_corr/rollout_is_ratio_fraction_low"]), lo_frac, atol=1e-6)


def test_gradient_through_tis_weights_is_zero():
    lp, old, roll, adv, m = _batch(7, scale=0.5)

    def loss_fn(old_, roll_):
        w, _ = token_tis(old_, roll_, jnp.asarray(m))
        return ppo_clip_loss(jnp.asarray(lp, jnp.float32), old_, jnp.asarray(adv, jnp.float32), jnp.asarray(m),
                             token_weights=w)[0]

    g_old, g_roll = jax.grad(loss_fn, argnums=(0, 1))(*_f32(old, roll))
    assert float(jnp.abs(g_old).sum()) == 0.0 and float(jnp.abs(g_roll).sum()) == 0.0
    g_old, g_roll = jax.grad(
        lambda o, r: compute_policy_loss(*_f32(lp), o, r, jnp.asarray(adv, jnp.float32), jnp.asarray(m))[0],
        argnums=(0, 1),
    )(*_f32(old, roll))
    assert float(jnp.abs(g_old).sum()) == 0.0 and float(jnp.abs(g_roll).sum()) == 0.0


# --------------------------------------------------------------------------------------------- metrics


@pytest.mark.parametrize("extreme", [False, True])
def test_rollout_corr_metrics(extreme):
    lp, old, roll, adv, m = _batch(11, extreme=extreme, contiguous=not extreme)
    got = jax.jit(rollout_corr_metrics)(*_f32(old, roll, m))
    ref = ref_offpolicy(old, roll, m)
    assert _finite(got)
    for k, v in ref.items():
        np.testing.assert_allclose(float(got["rollout_corr/" + k]), v, rtol=1e-4, atol=1e-4, err_msg=k)
    z = rollout_corr_metrics(*_f32(old, roll), jnp.zeros(m.shape))
    assert _finite(z) and all(float(v) == 0.0 for v in z.values())


# ------------------------------------------------------------------------------------- compute_policy_loss


def test_compute_policy_loss_default_is_ppo_with_token_tis():
    lp, old, roll, adv, m = _batch(13, extreme=True)
    cfg = LossConfig()
    assert cfg.rollout_correction == RolloutCorrectionConfig()
    assert cfg.rollout_correction.rollout_is == "token" and cfg.rollout_correction.rollout_is_threshold == 2.0
    assert not cfg.rollout_correction.bypass_mode and cfg.loss_agg_mode == "token-mean"
    loss, met = jax.jit(compute_policy_loss, static_argnums=5)(*_f32(lp, old, roll, adv, m), cfg)
    w = ref_tis(old, roll, m, 2.0)
    ref_loss, ref_met = ref_ppo(lp, old, adv, m, 0.2, 0.2, None, w)
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(float(met["actor/ppo_kl"]), ref_met["actor/ppo_kl"], rtol=1e-4, atol=1e-4)
    assert "rollout_corr/kl" in met and "rollout_corr/rollout_is_mean" in met and _finite(met)
    # no correction
    loss0, _ = compute_policy_loss(*_f32(lp, old, roll, adv, m), RolloutCorrectionConfig(rollout_is=None))
    np.testing.assert_allclose(float(loss0), ref_ppo(lp, old, adv, m, 0.2, 0.2)[0], rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="rollout_is"):
        RolloutCorrectionConfig(rollout_is="tokens")
