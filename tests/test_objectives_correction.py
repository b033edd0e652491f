"""Rollout-correction transforms (IS token/sequence/geometric x truncate/mask, lower clamp, veto, batch
normalization, rejection sampling k1/k2/k3, chain) against float64 numpy references written here from the
published formulas (verl rollout_corr_helper / earlier mismatch_helper, NeMo-RL, TRL), independently of
the library."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8rl_jax.objectives import (
    RS_OPTIONS,
    Identity,
    ImportanceSampling,
    RejectionSampling,
    Veto,
    chain,
    parse_is_threshold,
)

P = "rollout_corr/"


def make_batch(seed, B=9, T=8, scale=0.4, extreme=False, contiguous=True):
    rng = np.random.default_rng(seed)
    lens = rng.integers(0, T + 1, size=B)
    lens[0], lens[-1] = 0, T
    m = (np.arange(T)[None] < lens[:, None]).astype(np.float64)
    if not contiguous:
        m *= rng.random((B, T)) < 0.8
    old = -rng.exponential(1.5, size=(B, T))
    roll = old + scale * rng.normal(size=(B, T))
    if extreme:
        sel = rng.random((B, T)) < 0.25
        roll = np.where(sel, old + rng.choice([-100.0, 100.0], size=(B, T)), roll)
    old = np.where(m > 0, old, np.nan)
    roll = np.where(m > 0, roll, -np.inf)
    return old, roll, m


def f32(*xs):
    return [jnp.asarray(x, jnp.float32) for x in xs]


def finite(tree):
    return all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree_util.tree_leaves(tree))


def clip20(x):
    return min(max(x, -20.0), 20.0)


def rows_of(m):
    return [b for b in range(m.shape[0]) if m[b].sum() > 0]


def toks_of(m, b):
    return [t for t in range(m.shape[1]) if m[b, t] > 0]


def check_metrics(got, ref, tol=1e-4):
    for k, v in ref.items():
        assert P + k in got, k
        np.testing.assert_allclose(float(got[P + k]), v, rtol=tol, atol=tol, err_msg=k)


# ------------------------------------------------------------------------------------------ IS reference


def ref_is(old, roll, m, level, mode, hi, lo=None, veto=None, bn=False):
    B, T = m.shape
    lower = lo if lo is not None else 1.0 / hi
    raw = np.zeros((B, T))
    seq_log = {}
    for b in rows_of(m):
        lrs = [old[b, t] - roll[b, t] for t in toks_of(m, b)]
        if level == "token":
            for t in toks_of(m, b):
                raw[b, t] = math.exp(clip20(old[b, t] - roll[b, t]))
        else:
            s = sum(lrs) if level == "sequence" else sum(lrs) / len(lrs)
            seq_log[b] = s
            for t in toks_of(m, b):
                raw[b, t] = math.exp(clip20(s))
    all_t = [(b, t) for b in rows_of(m) for t in toks_of(m, b)]
    vals = np.array([raw[b, t] for b, t in all_t])
    met = {"rollout_is_mean": vals.mean()}
    if level == "token":
        met.update(rollout_is_max=vals.max(), rollout_is_min=vals.min(),
                   rollout_is_ratio_fraction_high=(vals > hi).mean(),
                   rollout_is_ratio_fraction_low=(vals < lower).mean())
    else:
        sl = np.array([seq_log[b] for b in rows_of(m)])
        met.update(rollout_is_max=math.exp(min(sl.max(), 20)), rollout_is_min=math.exp(min(sl.min(), 20)),
                   rollout_is_ratio_fraction_high=(sl > math.log(hi)).mean(),
                   rollout_is_ratio_fraction_low=(sl < (math.log(lower) if lower > 0 else -np.inf)).mean())
    wc = np.clip(vals, lower, hi)
    met["rollout_is_std"] = math.sqrt(max((wc ** 2).mean() - wc.mean() ** 2, 0.0))
    met["rollout_is_eff_sample_size"] = 1.0 / ((wc / (wc.mean() + 1e-8)) ** 2).mean()
    seq_w = np.array([np.mean([raw[b, t] for t in toks_of(m, b)]) for b in rows_of(m)])
    met.update(rollout_is_seq_mean=seq_w.mean(), rollout_is_seq_std=seq_w.std(ddof=1),
               rollout_is_seq_max=seq_w.max(), rollout_is_seq_min=seq_w.min(),
               rollout_is_seq_max_deviation=np.abs(seq_w - 1).max(),
               rollout_is_seq_fraction_high=(seq_w > hi).mean(), rollout_is_seq_fraction_low=(seq_w < lower).mean())
    w = np.zeros((B, T))
    rej = np.zeros((B, T))
    for b, t in all_t:
        x = raw[b, t]
        if mode == "truncate":
            x = min(x, hi)
            if lo is not None:
                x = max(x, lo)
        elif not (lower <= x <= hi):
            x, rej[b, t] = 0.0, 1.0
        w[b, t] = x
    if mode == "mask":
        met["rollout_is_masked_fraction"] = np.mean([rej[b, t] for b, t in all_t])
        met["rollout_is_seq_masked_fraction"] = np.mean([rej[b].max() > 0 for b in rows_of(m)])
    if veto is not None:
        vetoed = [any(old[b, t] - roll[b, t] < math.log(veto) for t in toks_of(m, b)) for b in rows_of(m)]
        cat = [float(old[b, t] - roll[b, t] < math.log(veto)) for b, t in all_t]
        met["rollout_is_veto_fraction"] = np.mean(vetoed)
        met["rollout_is_catastrophic_token_fraction"] = np.mean(cat)
        for b, v in zip(rows_of(m), vetoed):
            if v:
                w[b] = 0.0
    if bn:
        if level == "token":
            mean = np.mean([w[b, t] for b, t in all_t])
        else:
            mean = np.mean([np.mean([w[b, t] for t in toks_of(m, b)]) for b in rows_of(m)])
        if mean > 1e-8:
            w = w / mean
        met["rollout_is_batch_norm_factor"] = mean if mean > 1e-8 else 1.0
    return w, met


IS_CASES = [
    dict(level="token", mode="truncate", hi=2.0),
    dict(level="token", mode="truncate", hi=2.0, lo=0.5),
    dict(level="token", mode="truncate", hi=1.5, lo=0.0),
    dict(level="token", mode="mask", hi=2.0),
    dict(level="token", mode="mask", hi=5.0, lo=0.5),
    dict(level="sequence", mode="truncate", hi=2.0),
    dict(level="sequence", mode="mask", hi=3.0, lo=0.2),
    dict(level="geometric", mode="truncate", hi=1.2, lo=0.9),
    dict(level="geometric", mode="mask", hi=1.1),
    dict(level="token", mode="truncate", hi=2.0, veto=1e-2),
    dict(level="sequence", mode="truncate", hi=2.0, bn=True),
    dict(level="token", mode="mask", hi=2.0, bn=True, veto=0.1),
    dict(level="geometric", mode="truncate", hi=2.0, bn=True),
]


@pytest.mark.parametrize("extreme", [False, True])
@pytest.mark.parametrize("case", IS_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_importance_sampling_matches_reference(case, extreme):
    old, roll, m = make_batch(17, extreme=extreme, contiguous=not extreme, scale=0.3)
    t = ImportanceSampling(level=case["level"], mode=case["mode"], threshold=case["hi"],
                           threshold_lower=case.get("lo"), batch_normalize=case.get("bn", False),
                           veto_threshold=case.get("veto"))
    c = jax.jit(t)(*f32(old, roll, m))
    w_ref, met_ref = ref_is(old, roll, m, case["level"], case["mode"], case["hi"], case.get("lo"),
                            case.get("veto"), case.get("bn", False))
    np.testing.assert_allclose(np.asarray(c.weights), w_ref, rtol=2e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(c.mask), m)
    check_metrics(c.metrics, met_ref)
    assert finite(c) and float(jnp.min(c.weights)) >= 0


def test_is_entirely_masked_and_errors():
    old, roll, m = make_batch(1, extreme=True)
    z = jnp.zeros(m.shape)
    for t in [ImportanceSampling(level=lv, mode=md, batch_normalize=True, veto_threshold=1e-3)
              for lv in ("token", "sequence", "geometric") for md in ("truncate", "mask")]:
        c = t(*f32(old, roll), z)
        assert finite(c) and float(jnp.abs(c.weights).sum()) == 0.0
    with pytest.raises(ValueError, match="'token', 'sequence', 'geometric'"):
        ImportanceSampling(level="seq")
    with pytest.raises(ValueError, match="'truncate', 'mask'"):
        ImportanceSampling(mode="clip")
    with pytest.raises(ValueError, match="positive"):
        ImportanceSampling(threshold=0.0)
    with pytest.raises(ValueError, match="rollout_logprobs"):
        ImportanceSampling()(jnp.zeros((2, 3)), jnp.zeros((2, 4)), jnp.ones((2, 3)))


def test_parse_is_threshold():
    assert parse_is_threshold(2.0) == (None, 2.0)
    assert parse_is_threshold("0.5_2.0") == (0.5, 2.0)
    assert parse_is_threshold("3") == (None, 3.0)
    for bad in ("a_b", "2_1", "-1", "0.1_0.2_0.3", None, True):
        with pytest.raises(ValueError):
            parse_is_threshold(bad)


# ------------------------------------------------------------------------------------------ RS reference


def ref_parse(opts, spec):
    names = []
    for o in opts.split(","):
        o = o.strip()
        if o and o not in names:
            names.append(o)
    specs = str(spec).split(",")
    specs = specs * len(names) if len(specs) == 1 else specs
    out = []
    for n, s in zip(names, specs):
        if n.endswith("k1"):
            lo, hi = (float(s.split("_")[0]), float(s.split("_")[1])) if "_" in s else (1 / float(s), float(s))
            out.append((n, math.log(lo), math.log(hi)))
        else:
            out.append((n, None, float(s)))
    return out


def ref_rs(old, roll, m, opts, spec):
    B, T = m.shape
    rows = rows_of(m)
    all_t = [(b, t) for b in rows for t in toks_of(m, b)]

    def k(kind, b, t):
        r = clip20(old[b, t] - roll[b, t])
        return {"k1": -r, "k2": 0.5 * r * r, "k3": math.exp(r) - 1 - r}[kind]

    keep_all = np.ones((B, T))
    met = {}
    for name, lo, hi in ref_parse(opts, spec):
        kind = name[-2:]
        stat = np.zeros((B, T))
        seq = {}
        for b in rows:
            vals = [k(kind, b, t) for t in toks_of(m, b)]
            if name.startswith("token"):
                for t, v in zip(toks_of(m, b), vals):
                    stat[b, t] = v
            else:
                seq[b] = sum(vals) if "sum" in name else (np.mean(vals) if "mean" in name else max(vals))
                stat[b, toks_of(m, b)] = seq[b]
        ok = (lambda v: lo <= v <= hi) if lo is not None else (lambda v: v <= hi)
        keep = np.ones((B, T))
        for b, t in all_t:
            keep[b, t] = float(ok(stat[b, t]))
        keep_all *= keep
        p = f"rollout_rs_{name}_"
        tv = np.array([stat[b, t] for b, t in all_t])
        sv = np.array([seq[b] for b in rows]) if seq else np.array(
            [np.mean([stat[b, t] for t in toks_of(m, b)]) for b in rows])
        low = lo if lo is not None else 0.0
        level_vals = tv if name.startswith("token") else sv
        met[p + "mean"] = tv.mean()
        met[p + "max"] = level_vals.max()
        met[p + "min"] = level_vals.min()
        met[p + "fraction_high"] = (level_vals > hi).mean()
        met[p + "fraction_low"] = (level_vals < lo).mean() if lo is not None else 0.0
        sc = np.clip(tv, low, hi)
        met[p + "std"] = math.sqrt(max((sc ** 2).mean() - sc.mean() ** 2, 0))
        met[p + "seq_mean"] = sv.mean()
        met[p + "seq_std"] = sv.std(ddof=1)
        met[p + "seq_max"] = sv.max()
        met[p + "seq_min"] = sv.min()
        met[p + "seq_max_deviation"] = np.abs(sv).max()
        met[p + "seq_fraction_high"] = (sv > hi).mean()
        if lo is not None:
            met[p + "seq_fraction_low"] = (sv < lo).mean()
        met[p + "masked_fraction"] = np.mean([1 - keep[b, t] for b, t in all_t])
        met[p + "seq_masked_fraction"] = np.mean([min(keep[b, toks_of(m, b)]) == 0 for b in rows])
    met["rollout_rs_masked_fraction"] = np.mean([1 - keep_all[b, t] for b, t in all_t])
    met["rollout_rs_seq_masked_fraction"] = np.mean([min(keep_all[b, toks_of(m, b)]) == 0 for b in rows])
    return m * keep_all, met


RS_CASES = [
    ("token_k1", 1.5), ("token_k2", 0.05), ("token_k3", 0.05),
    ("seq_sum_k1", "0.5_2.0"), ("seq_sum_k2", 0.1), ("seq_sum_k3", 0.1),
    ("seq_mean_k1", "0.9_1.2"), ("seq_mean_k2", 0.04), ("seq_mean_k3", 0.04),
    ("seq_max_k2", 0.1), ("seq_max_k3", 0.1),
    ("token_k1,seq_mean_k3", "0.6_1.5,0.05"), ("seq_max_k2,token_k3,seq_max_k2", 0.12),
]


@pytest.mark.parametrize("extreme", [False, True])
@pytest.mark.parametrize("opts,spec", RS_CASES)
def test_rejection_sampling_matches_reference(opts, spec, extreme):
    old, roll, m = make_batch(23, extreme=extreme, contiguous=not extreme, scale=0.3)
    t = RejectionSampling(opts, spec)
    c = jax.jit(t)(*f32(old, roll, m))
    mask_ref, met_ref = ref_rs(old, roll, m, opts, spec)
    np.testing.assert_array_equal(np.asarray(c.mask), mask_ref)
    np.testing.assert_array_equal(np.asarray(c.weights), m)
    check_metrics(c.metrics, met_ref)
    assert finite(c)
    assert 0.0 < float(c.metrics[P + "rollout_rs_masked_fraction"]) < 1.0  # the case is not vacuous
    cw = RejectionSampling(opts, spec, apply_to="weights")(*f32(old, roll, m))
    np.testing.assert_array_equal(np.asarray(cw.weights), mask_ref)
    np.testing.assert_array_equal(np.asarray(cw.mask), m)


def test_rejection_sampling_errors_and_empty():
    with pytest.raises(ValueError, match="seq_mean_k3"):
        RejectionSampling("seq_mean_k4", 0.1)
    with pytest.raises(ValueError, match="seq_max_k2"):
        RejectionSampling("seq_max_k1", 0.1)
    with pytest.raises(ValueError, match="must be provided"):
        RejectionSampling("token_k2", None)
    with pytest.raises(ValueError, match="single upper bound"):
        RejectionSampling("token_k2", "0.1_0.2")
    with pytest.raises(ValueError, match="1 or 2"):
        RejectionSampling("token_k2,token_k3", "0.1,0.2,0.3")
    with pytest.raises(ValueError, match="positive"):
        RejectionSampling("token_k3", -1.0)
    old, roll, m = make_batch(2, extreme=True)
    for o in RS_OPTIONS:
        c = RejectionSampling(o, "0.5_2" if o.endswith("k1") else 0.1)(*f32(old, roll), jnp.zeros(m.shape))
        assert finite(c) and float(c.mask.sum()) == 0.0


# ---------------------------------------------------------------------------------------- veto / chain


def test_veto_and_chain():
    old, roll, m = make_batch(31, extreme=True)
    v = Veto(1e-3)(*f32(old, roll, m))
    ref_w = np.array([[float(m[b, t] and not any(old[b, s] - roll[b, s] < math.log(1e-3) for s in toks_of(m, b)))
                       for t in range(m.shape[1])] for b in range(m.shape[0])])
    np.testing.assert_array_equal(np.asarray(v.weights), ref_w)
    is_t = ImportanceSampling("sequence", "truncate", 2.0)
    rs_t = RejectionSampling("token_k2", 0.05)
    c = chain(is_t, rs_t, Veto(1e-3))(*f32(old, roll, m))
    w_is, _ = ref_is(old, roll, m, "sequence", "truncate", 2.0)
    mask_rs, _ = ref_rs(old, roll, m, "token_k2", 0.05)
    np.testing.assert_allclose(np.asarray(c.weights), w_is * ref_w, rtol=2e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(c.mask), mask_rs)
    assert P + "rollout_is_mean" in c.metrics and P + "rollout_rs_masked_fraction" in c.metrics
    assert P + "rollout_is_veto_fraction" in c.metrics
    ident = Identity()(*f32(old, roll, m))
    np.testing.assert_array_equal(np.asarray(ident.weights), m)
    nested = chain(chain(is_t), chain(rs_t))
    assert nested == chain(is_t, rs_t)
    with pytest.raises(ValueError, match="not a transform"):
        chain(is_t, 3)


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_mask_mode_apply_to_mask_moves_rejection_into_the_mask(level):
    """slime ``tis_mode: mask``: the weight stays rho, out-of-range tokens leave the mask."""
    old, roll, m = make_batch(41, extreme=True, scale=0.3)
    hi, lo = (2.0, 0.5) if level != "geometric" else (1.1, 0.9)
    c = ImportanceSampling(level, "mask", hi, lo, apply_to="mask")(*f32(old, roll, m))
    raw, _ = ref_is(old, roll, m, level, "truncate", np.inf, 0.0)  # unbounded weights = rho
    keep = np.where(m > 0, (raw >= lo) & (raw <= hi), 0.0)
    np.testing.assert_allclose(np.asarray(c.weights), raw, rtol=2e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(c.mask), keep)
    assert 0 < keep.sum() < m.sum()
    v = Veto(1e-3, apply_to="mask")(*f32(old, roll, m))
    vw = Veto(1e-3)(*f32(old, roll, m))
    np.testing.assert_array_equal(np.asarray(v.mask), np.asarray(vw.weights))
    np.testing.assert_array_equal(np.asarray(v.weights), m)
    with pytest.raises(ValueError, match="'weights', 'mask'"):
        ImportanceSampling(apply_to="loss")


def test_documented_framework_mappings():
    """The docs' mapping rows for NeMo-RL seq-mask-tis, TRL sequence_mask and slime rs, vs their formulas."""
    old, roll, m = make_batch(43, scale=0.05, T=10, B=12)
    a, C = 0.98, 1.01
    # NeMo-RL seq-mask-tis: raw token ratios, rows with geo-mean ratio outside [a, C] zeroed
    c = chain(ImportanceSampling("token", "truncate", float("inf")),
              RejectionSampling("seq_mean_k1", f"{1 / C}_{1 / a}", apply_to="weights"))(*f32(old, roll, m))
    ref = np.zeros(m.shape)
    for b in rows_of(m):
        geo = math.exp(np.mean([old[b, t] - roll[b, t] for t in toks_of(m, b)]))
        for t in toks_of(m, b):
            ref[b, t] = math.exp(old[b, t] - roll[b, t]) * (a <= geo <= C)
    np.testing.assert_allclose(np.asarray(c.weights), ref, rtol=2e-5, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(c.mask), m)
    assert 0 < (ref > 0).sum() < m.sum()
    assert finite(c.metrics)
    # TRL sequence_mask with clip_max=3, no lower bound: "0_3.0"
    lo, hi = parse_is_threshold("0_3.0")
    old2, roll2, m2 = make_batch(44, scale=0.4)
    c = ImportanceSampling("sequence", "mask", hi, lo)(*f32(old2, roll2, m2))
    ref = np.zeros(m2.shape)
    for b in rows_of(m2):
        r = math.exp(sum(old2[b, t] - roll2[b, t] for t in toks_of(m2, b)))
        ref[b] = m2[b] * (r if r <= 3.0 else 0.0)
    np.testing.assert_allclose(np.asarray(c.weights), ref, rtol=2e-5, atol=1e-7)
    assert finite(c.metrics)
    # slime rs (ratio window [a, b] on exp(sum log_rho)) == seq_sum_k1 "1/b_1/a"
    a2, b2 = 0.7, 1.3
    c = RejectionSampling("seq_sum_k1", f"{1 / b2}_{1 / a2}")(*f32(old2, roll2, m2))
    ref = np.zeros(m2.shape)
    for b in rows_of(m2):
        r = math.exp(sum(old2[b, t] - roll2[b, t] for t in toks_of(m2, b)))
        ref[b] = m2[b] * (a2 <= r <= b2)
    np.testing.assert_array_equal(np.asarray(c.mask), ref)


def test_two_sided_veto_matches_skyrl_and_prime_rl_outlier_rule():
    """SkyRL ``outlier_token_is_threshold_low/high`` / prime-rl ``sequence_mask_low/high``: a row is dropped
    when any real token's ratio ``exp(old - rollout)`` lies outside ``[low, high]``."""
    old, roll, m = make_batch(47, extreme=True, scale=0.6)
    low, high = 0.3, 2.5
    v = Veto(low, apply_to="mask", threshold_high=high)(*f32(old, roll, m))
    ref = np.zeros(m.shape)
    for b in rows_of(m):
        ratios = [math.exp(clip20(old[b, t] - roll[b, t])) for t in toks_of(m, b)]
        ref[b] = m[b] * all(low <= r <= high for r in ratios)
    np.testing.assert_array_equal(np.asarray(v.mask), ref)
    np.testing.assert_array_equal(np.asarray(v.weights), m)
    assert 0 < ref.sum() < m.sum()
    n_out = sum(not (low <= math.exp(clip20(old[b, t] - roll[b, t])) <= high) for b in rows_of(m) for t in toks_of(m, b))
    np.testing.assert_allclose(float(v.metrics[P + "rollout_is_catastrophic_token_fraction"]), n_out / m.sum(), rtol=1e-6)
    assert finite(v.metrics)
    with pytest.raises(ValueError, match="threshold_high"):
        Veto(0.5, threshold_high=0.4)
