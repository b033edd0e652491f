"""Off-policy sequence masking (DeepSeek-V3.2), trust region masking (arXiv 2512.23075), self-normalized IS
(verl #3980) and the entirely-masked-batch metric contract, against float64 numpy transcriptions of the
published formulas written here independently of the library.

Adversarial batches: empty rows, single-token rows, non-contiguous masks, |log-ratio| up to 50, and NaN /
+-inf in every padding position (log-probs and per-token advantages); nothing from padding may leak.
"""

from __future__ import annotations

import math

import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8rl_jax.objectives import (
    PRESETS,
    RS_OPTIONS,
    ImportanceSampling,
    LossConfig,
    OffPolicySequenceMasking,
    RejectionSampling,
    RolloutCorrectionConfig,
    TrustRegionMasking,
    Veto,
    apply_transform,
    chain,
    compute_policy_loss,
    rollout_corr_metrics,
    rollout_correction_preset,
)

P = "rollout_corr/"


# ------------------------------------------------------------------------------------------ batches


def adversarial(seed, B=14, T=7, big=True, scale=0.3):
    """(logprobs, old, rollout, adv [B], adv_tok [B, T], mask) as float64 arrays already rounded to float32,
    so the float64 references see exactly the library's inputs. Padding holds NaN / +-inf."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(0, T + 1, size=B)
    lens[0], lens[1], lens[2], lens[3], lens[-1] = 0, 1, 1, 0, T
    m = (np.arange(T)[None] < lens[:, None]).astype(np.float64)
    holes = rng.random((B, T)) < 0.2
    m[B // 2:] *= ~holes[B // 2:]  # non-contiguous rows in the second half
    lr = scale * rng.normal(size=(B, T))
    lr[rng.random((B, T)) < 0.3] *= 0.02  # near-on-policy tokens
    if big:
        sel = rng.random((B, T)) < 0.15
        lr = np.where(sel, rng.choice([-50.0, -25.0, 25.0, 50.0], size=(B, T)), lr)
    base = -rng.exponential(1.0, size=(B, T)) - 1e-3
    old = np.where(lr > 0, base, base + lr)  # both log-probs <= 0, old - roll = lr
    roll = np.where(lr > 0, base - lr, base)
    lp = old + 0.1 * rng.normal(size=(B, T))
    adv = rng.normal(size=B)
    adv[rng.random(B) < 0.15] = 0.0
    adv_tok = adv[:, None] + 0.5 * rng.normal(size=(B, T))
    junk = rng.choice([np.nan, np.inf, -np.inf], size=(5, B, T))
    lp, old, roll, adv_tok = (np.where(m > 0, x, j) for x, j in zip((lp, old, roll, adv_tok), junk))
    r32 = [np.asarray(np.float32(x), np.float64) for x in (lp, old, roll, adv, adv_tok)]
    return (*r32, m)


def f32(*xs):
    return [jnp.asarray(x, jnp.float32) for x in xs]


def finite(tree):
    return all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree_util.tree_leaves(tree))


def rows_of(m):
    return [b for b in range(m.shape[0]) if m[b].sum() > 0]


def toks_of(m, b):
    return [t for t in range(m.shape[1]) if m[b, t] > 0]


def check_metrics(got, ref, tol=1e-5):
    assert {P + k for k in ref} == set(got), sorted(set(got) ^ {P + k for k in ref})
    for k, v in ref.items():
        np.testing.assert_allclose(float(got[P + k]), v, rtol=tol, atol=tol, err_msg=k)


def mean(xs):
    return float(np.mean(xs)) if len(xs) else 0.0


def max_(xs):
    return float(np.max(xs)) if len(xs) else 0.0


# ----------------------------------------------------------------------- OPSM (DeepSeek-V3.2, sec. 3.1)


def ref_opsm(old, roll, m, adv, delta):
    """M_{i,t} = 0 if A_{i,t} < 0 and (1/|o_i|) sum_t log(pi_old / pi_theta) > delta, else 1; here pi_old is
    the sampler (rollout_logprobs) and pi_theta the trained side (old_logprobs)."""
    B, T = m.shape
    adv = np.broadcast_to(adv[:, None], (B, T)) if adv.ndim == 1 else adv
    keep = np.zeros((B, T))
    kls = {}
    for b in rows_of(m):
        toks = toks_of(m, b)
        kls[b] = sum(roll[b, t] - old[b, t] for t in toks) / len(toks)
        for t in toks:
            keep[b, t] = 0.0 if (adv[b, t] < 0 and kls[b] > delta) else 1.0
    rows = rows_of(m)
    all_t = [(b, t) for b in rows for t in toks_of(m, b)]
    met = {
        "opsm_masked_fraction": mean([1 - keep[b, t] for b, t in all_t]),
        "opsm_seq_masked_fraction": mean([any(keep[b, t] == 0 for t in toks_of(m, b)) for b in rows]),
        "opsm_seq_kl_mean": mean([kls[b] for b in rows]),
        "opsm_seq_kl_max": max_([kls[b] for b in rows]),
        "opsm_seq_kl_fraction_high": mean([kls[b] > delta for b in rows]),
    }
    return keep, met


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("delta", [0.0, 1e-4, 0.05, 2.0])
@pytest.mark.parametrize("big", [False, True])
def test_opsm_matches_deepseek_formula(delta, per_token, big):
    _, old, roll, adv, adv_tok, m = adversarial(3, big=big)
    a = adv_tok if per_token else adv
    keep, met = ref_opsm(old, roll, m, a, delta)
    for apply_to in ("weights", "mask"):
        t = OffPolicySequenceMasking(delta, apply_to=apply_to)
        c = jax.jit(lambda o, r, mm, aa: t(o, r, mm, aa))(*f32(old, roll, m, a))
        got_keep = np.asarray(c.weights if apply_to == "weights" else c.mask)
        np.testing.assert_array_equal(got_keep, keep)
        np.testing.assert_array_equal(np.asarray(c.mask if apply_to == "weights" else c.weights), m)
        check_metrics(c.metrics, met)
        assert finite(c)
    if delta <= 0.05:  # the case is not vacuous: something is dropped, something kept
        assert 0 < (keep * m).sum() < m.sum()


def test_opsm_keeps_positive_advantages_and_is_one_sided():
    """Only row 1 (A < 0, mean(rollout - old) = 4 > delta) is dropped; row 2 is as far off-policy in the
    other direction (mean(rollout - old) = -4, the statistic is signed) and rows 0, 3 have A >= 0."""
    old = np.array([[-1.0, -1.0], [-5.0, -5.0], [-1.0, -1.0], [-1.0, -1.0]])
    roll = np.array([[-5.0, -5.0], [-1.0, -1.0], [-5.0, -5.0], [-5.0, -5.0]])
    m = np.array([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
    adv = np.array([1.0, -1.0, -1.0, 0.0])
    c = OffPolicySequenceMasking(0.5)(*f32(old, roll, m, adv))
    np.testing.assert_array_equal(np.asarray(c.weights), [[1, 1], [0, 0], [1, 1], [1, 0]])


def test_opsm_grad_safe_jit_vmap_and_errors():
    _, old, roll, adv, adv_tok, m = adversarial(4)
    t = OffPolicySequenceMasking(0.01)
    g = jax.grad(lambda o, r: jnp.sum(t(o, r, *f32(m, adv)).weights * o), argnums=(0, 1))(*f32(old, roll))
    # the weights are stop-gradient: d/d old of sum(w * old) is w itself, d/d rollout is 0
    np.testing.assert_array_equal(np.asarray(g[0]), np.asarray(t(*f32(old, roll, m, adv)).weights))
    assert finite(g) and float(jnp.abs(g[1]).sum()) == 0.0
    st = [jnp.stack([x, x[::-1]]) for x in f32(old, roll, m, adv_tok)]
    cv = jax.vmap(t)(*st)
    np.testing.assert_array_equal(np.asarray(cv.weights[0]), np.asarray(t(*f32(old, roll, m, adv_tok)).weights))
    for bad in (-1e-3, float("nan"), float("inf"), True, "0.1"):
        with pytest.raises(ValueError, match="opsm_delta"):
            OffPolicySequenceMasking(bad)
    with pytest.raises(ValueError, match="'weights', 'mask'"):
        OffPolicySequenceMasking(0.1, apply_to="loss")
    with pytest.raises(ValueError, match="advantages"):
        OffPolicySequenceMasking(0.1)(*f32(old, roll, m))
    with pytest.raises(ValueError, match="advantages"):
        apply_transform(chain(OffPolicySequenceMasking(0.1)), *f32(old, roll, m))
    with pytest.raises(ValueError, match="shape mismatch: advantages"):
        OffPolicySequenceMasking(0.1)(*f32(old, roll, m), jnp.zeros(3))
    with pytest.raises(ValueError, match="shape mismatch"):
        OffPolicySequenceMasking(0.1)(*f32(old, roll[:, :-1], m, adv))


def ref_ppo_tok(lp, old, adv, m, lo=0.2, hi=0.2):
    """Per-token PPO clipped loss max(-A r, -A clip(r, 1-lo, 1+hi)), r = exp(clamp(lp - old, +-20)); 0 off-mask."""
    B, T = m.shape
    adv = np.broadcast_to(adv[:, None], (B, T)) if adv.ndim == 1 else adv
    f = np.zeros((B, T))
    for b in rows_of(m):
        for t in toks_of(m, b):
            r = math.exp(min(max(lp[b, t] - old[b, t], -20.0), 20.0))
            f[b, t] = max(-adv[b, t] * r, -adv[b, t] * min(max(r, 1 - lo), 1 + hi))
    return f


def test_bypass_ppo_clip_opsm_is_the_deepseek_objective():
    """J = 1/G sum_i 1/|o_i| sum_t min(r A, clip(r) A) M_{i,t}, r = pi_theta / pi_rollout (loss = -J)."""
    lp, old, roll, adv, adv_tok, m = adversarial(5, big=False, scale=0.4)
    delta = 0.02
    for a in (adv, adv_tok):
        cfg = LossConfig(rollout_correction=RolloutCorrectionConfig.bypass_ppo_clip_opsm(delta),
                         loss_agg_mode="seq-mean-token-mean")
        loss, met = jax.jit(lambda *xs: compute_policy_loss(*xs, cfg))(*f32(lp, old, roll, a, m))
        keep, _ = ref_opsm(lp, roll, m, a, delta)  # the trained side is sg(logprobs) in bypass mode
        f = ref_ppo_tok(lp, roll, a, m) * keep
        ref = mean([f[b, toks_of(m, b)].mean() for b in rows_of(m)])
        np.testing.assert_allclose(float(loss), ref, rtol=1e-5, atol=1e-6)
        assert 0 < float(met[P + "opsm_masked_fraction"]) < 1 and finite((loss, met))
    # decoupled: the mask comes from old vs rollout, the ratio is pi / old
    cfg = LossConfig(rollout_correction=RolloutCorrectionConfig.decoupled_opsm(delta))
    loss, _ = compute_policy_loss(*f32(lp, old, roll, adv, m), cfg)
    keep, _ = ref_opsm(old, roll, m, adv, delta)
    f = ref_ppo_tok(lp, old, adv, m) * keep
    np.testing.assert_allclose(float(loss), f.sum() / m.sum(), rtol=1e-5, atol=1e-6)
    # the same transform through a custom chain (advantages reach the member)
    custom = LossConfig(transform=chain(ImportanceSampling("token", "truncate", float("inf")),
                                        OffPolicySequenceMasking(delta)))
    loss_c, _ = compute_policy_loss(*f32(lp, old, roll, adv, m), custom)
    w = np.where(m > 0, np.exp(np.clip(np.where(m > 0, old, 0.0) - np.where(m > 0, roll, 0.0), -20, 20)), 0.0)
    np.testing.assert_allclose(float(loss_c), (f * w).sum() / m.sum(), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ TRM (arXiv 2512.23075, sec. 4)


def ref_trm(old, roll, m, dmax, davg):
    """M = I[max_t k2 <= dmax] * I[mean_t k3 <= davg], k2 = log(rho)^2 / 2, k3 = rho - 1 - log rho,
    log rho clamped to +-20 (verl's SAFETY_BOUND)."""
    B, T = m.shape
    keep = np.zeros((B, T))
    mx, av, fmax, favg, veto = {}, {}, {}, {}, []
    for b in rows_of(m):
        rs = [min(max(old[b, t] - roll[b, t], -20.0), 20.0) for t in toks_of(m, b)]
        k2 = [0.5 * r * r for r in rs]
        k3 = [math.exp(r) - 1 - r for r in rs]
        mx[b], av[b] = max(k2), sum(k3) / len(k3)
        fmax[b] = dmax is not None and mx[b] > dmax
        favg[b] = davg is not None and av[b] > davg
        veto += [dmax is not None and v > dmax for v in k2]
        keep[b, toks_of(m, b)] = float(not (fmax[b] or favg[b]))
    rows = rows_of(m)
    met = {
        "trm_masked_fraction": mean([1 - keep[b, t] for b in rows for t in toks_of(m, b)]),
        "trm_seq_masked_fraction": mean([fmax[b] or favg[b] for b in rows]),
        "trm_max_seq_masked_fraction": mean([fmax[b] for b in rows]),
        "trm_avg_seq_masked_fraction": mean([favg[b] for b in rows]),
        "trm_token_veto_fraction": mean(veto),
        "trm_seq_max_k2_max": max_([mx[b] for b in rows]),
        "trm_seq_mean_k3_mean": mean([av[b] for b in rows]),
        "trm_seq_mean_k3_max": max_([av[b] for b in rows]),
    }
    return keep, met


TRM_CASES = [(0.1, 0.002), (0.05, None), (None, 0.001), (0.02, 0.05), (1.0, 10.0)]


@pytest.mark.parametrize("dmax,davg", TRM_CASES)
@pytest.mark.parametrize("big", [False, True])
def test_trm_matches_paper_formula(dmax, davg, big):
    _, old, roll, _, _, m = adversarial(7, big=big, scale=0.2)
    keep, met = ref_trm(old, roll, m, dmax, davg)
    for apply_to in ("mask", "weights"):
        t = TrustRegionMasking(dmax, davg, apply_to=apply_to)
        c = jax.jit(t)(*f32(old, roll, m))
        got_keep = np.asarray(c.mask if apply_to == "mask" else c.weights)
        np.testing.assert_array_equal(got_keep, keep)
        np.testing.assert_array_equal(np.asarray(c.weights if apply_to == "mask" else c.mask), m)
        check_metrics(c.metrics, met)
        assert finite(c)
    if big:  # not vacuous: the rows holding a |log rho| >= 25 token are dropped, others kept
        assert 0 < keep.sum() < m.sum()
    # the token veto in log-ratio units: a row is vetoed iff a real token has |log rho| > sqrt(2 dmax)
    if dmax is not None and davg is None:
        tau = TrustRegionMasking(dmax, None).token_veto_log_ratio
        veto_rows = [any(abs(old[b, t] - roll[b, t]) > tau for t in toks_of(m, b)) for b in rows_of(m)]
        assert [keep[b].sum() == 0 for b in rows_of(m)] == veto_rows
        v = Veto(math.exp(-tau), threshold_high=math.exp(tau), apply_to="mask")(*f32(old, roll, m))
        np.testing.assert_array_equal(np.asarray(v.mask), keep)


def test_trm_equals_verl_rollout_rs_realisation_and_preset():
    """verl PR #4544: rollout_rs="seq_max_k2,seq_mean_k3" gives the same mask; the preset is that config."""
    lp, old, roll, adv, _, m = adversarial(8, scale=0.2)
    for dmax, davg in [(0.1, 0.002), (0.05, 0.01)]:
        trm = TrustRegionMasking(dmax, davg)(*f32(old, roll, m))
        rs = RejectionSampling("seq_max_k2,seq_mean_k3", f"{dmax},{davg}")(*f32(old, roll, m))
        np.testing.assert_array_equal(np.asarray(trm.mask), np.asarray(rs.mask))
        rc = RolloutCorrectionConfig.decoupled_trm_rs(dmax, davg)
        assert rc == RolloutCorrectionConfig(rollout_is=None, rollout_rs="seq_max_k2,seq_mean_k3",
                                             rollout_rs_threshold=f"{dmax},{davg}")
        a = f32(lp, old, roll, adv, m)
        l_preset, _ = compute_policy_loss(*a, LossConfig(rollout_correction=rc))
        l_trm, _ = compute_policy_loss(*a, LossConfig(rollout_correction=RolloutCorrectionConfig(rollout_is=None),
                                                      transform=TrustRegionMasking(dmax, davg)))
        np.testing.assert_allclose(float(l_preset), float(l_trm), rtol=1e-6, atol=1e-7)
    assert RolloutCorrectionConfig.bypass_ppo_clip_trm_rs().bypass_mode


def test_trm_errors():
    with pytest.raises(ValueError, match="max_threshold and/or avg_threshold"):
        TrustRegionMasking(None, None)
    for bad in (0.0, -1.0, True):
        with pytest.raises(ValueError, match="max_threshold"):
            TrustRegionMasking(bad, 0.1)
        with pytest.raises(ValueError, match="avg_threshold"):
            TrustRegionMasking(0.1, bad)
    with pytest.raises(ValueError, match="'mask', 'weights'"):
        TrustRegionMasking(apply_to="both")
    with pytest.raises(ValueError, match="shape mismatch"):
        TrustRegionMasking()(jnp.zeros((2, 3)), jnp.zeros((2, 4)), jnp.ones((2, 3)))


def test_gin_bindings_of_the_new_transforms_and_presets():
    try:
        gin.clear_config()
        gin.parse_config("LossConfig.transform = @TrustRegionMasking()\n"
                         "TrustRegionMasking.max_threshold = 0.05\n"
                         "TrustRegionMasking.avg_threshold = None\n")
        assert LossConfig().transform == TrustRegionMasking(0.05, None)
        gin.clear_config()
        gin.parse_config("fp8rl_jax.objectives.OffPolicySequenceMasking.opsm_delta = 0.3\n"
                         "RolloutCorrectionConfig.opsm_delta = 0.2")
        assert OffPolicySequenceMasking().opsm_delta == 0.3
        assert LossConfig().rollout_correction.opsm_delta == 0.2
        gin.clear_config()
        gin.parse_config("LossConfig.rollout_correction = @rollout_correction_preset()\n"
                         "rollout_correction_preset.name = 'bypass_ppo_clip_opsm'")
        assert LossConfig().rollout_correction == RolloutCorrectionConfig.bypass_ppo_clip_opsm()
    finally:
        gin.clear_config()
    for name in ("decoupled_trm_rs", "bypass_ppo_clip_trm_rs", "decoupled_opsm", "bypass_ppo_clip_opsm"):
        assert name in PRESETS and rollout_correction_preset(name) == getattr(RolloutCorrectionConfig, name)()


# ------------------------------------------------------------- self-normalized IS (verl #3980)


def ref_tis_weights(old, roll, m, level, C):
    """Truncated IS weights min(rho, C) on real tokens, rho per token or per row (exp of the clamped sum)."""
    B, T = m.shape
    w = np.zeros((B, T))
    for b in rows_of(m):
        lrs = [old[b, t] - roll[b, t] for t in toks_of(m, b)]
        for t, x in zip(toks_of(m, b), lrs):
            s = x if level == "token" else sum(lrs)
            w[b, t] = min(math.exp(min(max(s, -20.0), 20.0)), C)
    return w


def ref_batch_norm(w, m, level):
    """verl after #3980 (``rollout_is_batch_normalize``): token level w / (sum m w / sum m); sequence level
    w / (mean over non-empty rows of the row's mean weight); skipped when that mean is <= 1e-8."""
    if level == "token":
        d = sum(w[b, t] for b in rows_of(m) for t in toks_of(m, b)) / m.sum()
    else:
        d = mean([w[b, toks_of(m, b)].mean() for b in rows_of(m)])
    return (w / d if d > 1e-8 else w), d


@pytest.mark.parametrize("big", [False, True])
@pytest.mark.parametrize("level,agg", [("token", "token-mean"), ("sequence", "seq-mean-token-mean")])
def test_batch_normalize_is_verl_snis(level, agg, big):
    """Our ``rollout_is_batch_normalize`` equals verl's merged #3980 normalisation, and the loss it gives is
    the self-normalized estimator sum_i w_i f_i / sum_i w_i (over tokens with token-mean, over rows with
    seq-mean-token-mean)."""
    lp, old, roll, adv, _, m = adversarial(11, big=big, scale=0.3)
    C = 3.0
    c = ImportanceSampling(level, "truncate", C, batch_normalize=True)(*f32(old, roll, m))
    w_raw = ref_tis_weights(old, roll, m, level, C)
    w_ref, d = ref_batch_norm(w_raw, m, level)
    np.testing.assert_allclose(np.asarray(c.weights), w_ref, rtol=2e-5, atol=1e-7)
    np.testing.assert_allclose(float(c.metrics[P + "rollout_is_batch_norm_factor"]), d, rtol=2e-5)
    rc = RolloutCorrectionConfig(rollout_is=level, rollout_is_threshold=C, rollout_is_batch_normalize=True)
    loss, _ = compute_policy_loss(*f32(lp, old, roll, adv, m), LossConfig(rollout_correction=rc, loss_agg_mode=agg))
    f = ref_ppo_tok(lp, old, adv, m)
    if level == "token":
        snis = (w_raw * f).sum() / (w_raw * m).sum()
    else:
        rows = rows_of(m)
        wb = [w_raw[b, toks_of(m, b)[0]] for b in rows]
        fb = [f[b, toks_of(m, b)].mean() for b in rows]
        snis = sum(x * y for x, y in zip(wb, fb)) / sum(wb)
    np.testing.assert_allclose(float(loss), snis, rtol=2e-5, atol=1e-6)


# ---------------------------------------------------- an entirely masked batch: every metric is 0


def all_transforms():
    ts = [ImportanceSampling(lv, md, 2.0, lo, batch_normalize=bn, veto_threshold=v)
          for lv in ("token", "sequence", "geometric") for md in ("truncate", "mask")
          for lo in (None, 0.5) for bn in (False, True) for v in (None, 1e-3)]
    ts += [RejectionSampling(o, "0.5_2" if o.endswith("k1") else 0.1) for o in RS_OPTIONS]
    ts += [Veto(1e-3), Veto(0.1, threshold_high=5.0, apply_to="mask"), OffPolicySequenceMasking(0.0),
           TrustRegionMasking(), TrustRegionMasking(0.05, None), TrustRegionMasking(None, 0.01)]
    return ts


def test_issue_20_reproduction_all_masked_metrics_are_zero():
    z = jnp.zeros((2, 3))
    met = ImportanceSampling("sequence", "truncate", 2.0)(z, z, z).metrics
    assert float(met[P + "rollout_is_max"]) == 0.0
    met = ImportanceSampling("geometric", "truncate", 2.0, batch_normalize=True)(z, z, z).metrics
    assert float(met[P + "rollout_is_max"]) == 0.0 and float(met[P + "rollout_is_batch_norm_factor"]) == 0.0


@pytest.mark.parametrize("shape", [(2, 3), (3, 1), (1, 5)])
def test_entirely_masked_batch_every_metric_is_zero(shape):
    junk = np.random.default_rng(0).choice([np.nan, np.inf, -np.inf, 50.0, -50.0], size=(3,) + shape)
    z = np.zeros(shape)
    for t in all_transforms():
        c = apply_transform(t, *f32(*junk[:2], z), jnp.asarray(junk[2][:, 0]))
        bad = {k: float(v) for k, v in c.metrics.items() if float(v) != 0.0}
        assert not bad, (t, bad)
        assert float(jnp.abs(c.weights).sum()) == 0.0 and float(jnp.abs(c.mask).sum()) == 0.0
        assert finite(c), t
    met = rollout_corr_metrics(*f32(*junk[:2], z))
    assert all(float(v) == 0.0 for v in met.values()), met
    for name in PRESETS:
        for mode in ("vanilla", "gspo"):
            cfg = LossConfig(rollout_correction=rollout_correction_preset(name), loss_mode=mode)
            loss, met = compute_policy_loss(*f32(*junk, junk[2][:, 0], z), cfg)
            bad = {k: float(v) for k, v in met.items() if float(v) != 0.0}
            assert float(loss) == 0.0 and not bad, (name, mode, bad)


def test_k3_is_exact_for_tiny_log_ratios():
    """k3 = E[exp(d) - 1 - d] for |d| ~ 5e-6 (a float32 engine vs the trainer): non-negative and within 1% of the
    float64 value (exp(d) - 1 - d in float32 cancels to 0 or below; expm1 keeps it)."""
    import jax.numpy as jnp
    import numpy as np

    from fp8rl_jax import objectives

    d = np.random.default_rng(0).normal(0, 5e-6, (32, 32)).astype(np.float32)
    got = float(objectives.rollout_corr_metrics(jnp.asarray(d - 3.0), jnp.full((32, 32), -3.0, jnp.float32),
                                                jnp.ones((32, 32)))["rollout_corr/k3_kl"])
    d64 = np.float64(d - 3.0) - (-3.0)
    want = float(np.mean(np.expm1(d64) - d64))
    assert got >= 0 and abs(got - want) <= 0.01 * want, (got, want)
