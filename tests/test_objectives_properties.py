"""Hypothesis property tests for the rollout-correction transforms and the full policy loss:
weights >= 0 and finite, stop-gradient, masked tokens contribute nothing, chain order does not matter."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from fp8rl_jax.objectives import (
    PRESETS,
    ImportanceSampling,
    LossConfig,
    RejectionSampling,
    Veto,
    chain,
    compute_policy_loss,
    rollout_correction_preset,
)

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])

TRANSFORMS = [
    ImportanceSampling("token", "truncate", 2.0),
    ImportanceSampling("token", "truncate", 2.0, threshold_lower=0.5),
    ImportanceSampling("token", "mask", 2.0),
    ImportanceSampling("sequence", "truncate", 3.0, batch_normalize=True),
    ImportanceSampling("sequence", "mask", 2.0),
    ImportanceSampling("geometric", "mask", 1.1, veto_threshold=1e-3),
    ImportanceSampling("geometric", "truncate", 2.0, batch_normalize=True),
    RejectionSampling("token_k1", "0.5_2.0"),
    RejectionSampling("seq_sum_k3", 0.5),
    RejectionSampling("seq_mean_k1,seq_max_k2", "0.9_1.1,1.0"),
    RejectionSampling("seq_mean_k3", 0.1, apply_to="weights"),
    Veto(1e-2),
    ImportanceSampling("token", "mask", 1.5, 0.7, apply_to="mask"),
    Veto(1e-3, apply_to="mask"),
]
# batch normalization rescales by the product of everything before it, so it is the one non-commuting
# member; the commuting set leaves it out
COMMUTING = [t for t in TRANSFORMS if not getattr(t, "batch_normalize", False)]


@st.composite
def batches(draw):
    # two sizes per axis, the edge (1) and a ragged one: the properties are about values, masks and junk, and each
    # new shape recompiles every eager op (20 shapes made this file ~100 s of the suite)
    B = draw(st.sampled_from([1, 3]))
    T = draw(st.sampled_from([1, 5]))
    val = st.floats(-110.0, 0.0, allow_nan=False, width=32)
    lp = draw(hnp.arrays(np.float32, (B, T), elements=val))
    old = draw(hnp.arrays(np.float32, (B, T), elements=val))
    roll = draw(hnp.arrays(np.float32, (B, T), elements=val))
    mask = draw(hnp.arrays(np.bool_, (B, T)))
    adv = draw(hnp.arrays(np.float32, (B,), elements=st.floats(-3, 3, width=32)))
    junk = draw(hnp.arrays(np.float32, (3, B, T), elements=st.sampled_from([np.nan, -np.inf, np.inf, 5.0, -1e4])))
    return lp, old, roll, mask, adv, junk


transform_lists = st.lists(st.sampled_from(TRANSFORMS), min_size=1, max_size=3)


def finite(tree):
    return all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree_util.tree_leaves(tree))


@SETTINGS
@given(batches(), transform_lists)
def test_weights_nonnegative_finite_and_zero_on_padding(batch, ts):
    lp, old, roll, mask, adv, junk = batch
    c = chain(*ts)(old, roll, mask)
    w, m = np.asarray(c.weights), np.asarray(c.mask)
    assert finite(c)
    assert (w >= 0).all()
    assert (w[~mask] == 0).all() and (m[~mask] == 0).all()
    assert set(np.unique(m)) <= {0.0, 1.0}


@SETTINGS
@given(batches(), transform_lists)
def test_stop_gradient_through_the_correction(batch, ts):
    lp, old, roll, mask, adv, junk = batch
    t = chain(*ts)
    g = jax.grad(lambda o, r: jnp.sum(t(o, r, mask).weights) + jnp.sum(t(o, r, mask).mask), argnums=(0, 1))(
        jnp.asarray(old), jnp.asarray(roll))
    assert all(float(jnp.abs(x).sum()) == 0.0 for x in g)
    cfg = LossConfig(transform=t)
    g = jax.grad(lambda o, r: compute_policy_loss(jnp.asarray(lp), o, r, adv, mask, cfg)[0], argnums=(0, 1))(
        jnp.asarray(old), jnp.asarray(roll))
    assert all(float(jnp.abs(x).sum()) == 0.0 for x in g)


@SETTINGS
@given(batches(), st.sampled_from(PRESETS), st.sampled_from(["token-mean", "seq-mean-token-mean",
                                                              "seq-mean-token-sum", "seq-mean-token-sum-norm"]))
def test_masked_tokens_contribute_nothing(batch, preset, agg):
    lp, old, roll, mask, adv, junk = batch
    cfg = LossConfig(rollout_correction=rollout_correction_preset(preset), loss_agg_mode=agg, clip_ratio_c=3.0)
    j_lp, j_old, j_roll = (np.where(mask, x, j) for x, j in zip((lp, old, roll), junk))
    f = lambda a, b, c: compute_policy_loss(a, b, c, adv, mask, cfg)  # noqa: E731
    loss, met = f(lp, old, roll)
    loss_j, met_j = f(j_lp, j_old, j_roll)
    assert finite((loss, met)) and finite((loss_j, met_j))
    assert float(loss) == float(loss_j)
    for k in met:
        assert float(met[k]) == float(met_j[k]), k
    g = jax.grad(lambda x: f(x, j_old, j_roll)[0])(jnp.asarray(j_lp))
    assert finite(g) and float(jnp.abs(jnp.where(mask, 0.0, g)).sum()) == 0.0


@SETTINGS
@given(batches(), st.lists(st.sampled_from(COMMUTING), min_size=2, max_size=3))
def test_chain_order_does_not_matter(batch, ts):
    lp, old, roll, mask, adv, junk = batch
    ref = chain(*ts)(old, roll, mask)
    for perm in itertools.permutations(ts):
        c = chain(*perm)(old, roll, mask)
        np.testing.assert_allclose(np.asarray(c.weights), np.asarray(ref.weights), rtol=1e-6, atol=0)
        np.testing.assert_array_equal(np.asarray(c.mask), np.asarray(ref.mask))
        assert set(c.metrics) == set(ref.metrics)
