"""Issue 30's defect: ``RolloutCorrectionConfig.opsm_delta`` applies with a custom ``LossConfig.transform`` too.

One row, rollout - old log-ratio 0.5 on every token (kl_b = 0.5 > delta = 0.05) and a negative advantage: OPSM
(DeepSeek-V3.2, slime ``compute_opsm_mask``) drops the row, so the loss is 0; without OPSM the PPO-clip loss of the
row is ``-A * ratio = 1.0`` (decoupled: ratio to old = 1) or 0.8 (bypass: ratio to the sampler exp(-0.5) = 0.61,
clipped to 1 - 0.2). Both regimes (decoupled and bypass), with a custom transform
(an ``Identity`` or the library's ``TrustRegionMasking`` with thresholds it never reaches) and without one.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from fp8rl_jax.objectives import LossConfig, RolloutCorrectionConfig, compute_policy_loss
from fp8rl_jax.objectives.rollout_correction import Identity


def _row():
    old = jnp.full((1, 4), -1.0, jnp.float32)
    return old, old, old + 0.5, jnp.asarray([-1.0]), jnp.ones((1, 4), bool)  # logprobs, old, rollout, A, mask


@pytest.mark.parametrize("bypass", [False, True])
@pytest.mark.parametrize("transform", [None, "identity", "trm"])
def test_opsm_delta_drops_the_row_with_and_without_a_custom_transform(bypass, transform):
    from fp8rl_jax.objectives import TrustRegionMasking

    t = {None: None, "identity": Identity(), "trm": TrustRegionMasking(max_threshold=100.0, avg_threshold=100.0)}[transform]
    lp, old, rollout, adv, mask = _row()
    rc = RolloutCorrectionConfig(rollout_is=None, opsm_delta=0.05, bypass_mode=bypass)
    loss, metrics = compute_policy_loss(lp, old, rollout, adv, mask, LossConfig(rollout_correction=rc, transform=t))
    assert float(loss) == 0.0
    assert float(metrics["rollout_corr/opsm_masked_fraction"]) == 1.0
    no_opsm = RolloutCorrectionConfig(rollout_is=None, bypass_mode=bypass)
    loss_plain, _ = compute_policy_loss(lp, old, rollout, adv, mask, LossConfig(rollout_correction=no_opsm, transform=t))
    np.testing.assert_allclose(float(loss_plain), 0.8 if bypass else 1.0, rtol=1e-6)
