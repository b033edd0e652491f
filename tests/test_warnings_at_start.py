"""Settings that silently do nothing say so (issue 39, items 13 and 14) and the run's closing TensorBoard line works
in the environment it runs in (item 10).

* A rollout correction that keeps (almost) no tokens for several steps warns once, naming
  ``train.min_kept_fraction`` (:mod:`fp8rl_jax.trainer.correction_watch`); the kept fraction is checked against an
  independent NumPy count of the tokens the correction's definition keeps.
* ``train.partial_rollout=True`` with ``partial_rollout_tokens`` >= the response budget warns when the trainer starts,
  before any model is loaded.
"""

from __future__ import annotations

import math
import os
import sys
import types
import warnings

import numpy as np
import pytest


def _batch(diffs, lengths, T=6):
    """Logprob arrays whose per-token ``old - rollout`` is ``diffs[row]`` on the row's first ``lengths[row]``
    tokens."""
    rng = np.random.default_rng(0)
    B = len(diffs)
    rollout = rng.uniform(-3.0, -0.1, size=(B, T)).astype(np.float32)
    old = rollout + np.asarray(diffs, np.float32)[:, None]
    mask = (np.arange(T)[None, :] < np.asarray(lengths)[:, None]).astype(np.float32)
    return old, rollout, mask


# ---------------------------------------------------------------------------------------------------------------
# 13. kept fraction
# ---------------------------------------------------------------------------------------------------------------
def test_kept_fraction_of_a_token_mask_correction_matches_numpy():
    from fp8rl_jax.objectives import LossConfig, RolloutCorrectionConfig
    from fp8rl_jax.trainer.correction_watch import kept_token_fraction

    # token-level IS in mask mode (MIS): a token is kept when exp(old - rollout) lies in [1/C, C] = [0.5, 2]
    rc = RolloutCorrectionConfig(rollout_is="token", rollout_is_mode="mask", rollout_is_threshold=2.0)
    rng = np.random.default_rng(1)
    old, rollout, mask = _batch([0.0, 0.0, 0.0, 0.0], [6, 4, 2, 5])
    old = old + rng.choice([0.0, 0.3, -1.0, 1.2], size=old.shape).astype(np.float32)  # some outside [ln .5, ln 2]
    ratio = np.exp(old.astype(np.float64) - rollout.astype(np.float64))
    want = float(((ratio >= 0.5) & (ratio <= 2.0) & (mask > 0)).sum() / (mask > 0).sum())
    assert 0 < want < 1
    got = kept_token_fraction(LossConfig(rollout_correction=rc), old, rollout, mask)
    assert math.isclose(got, want, abs_tol=1e-6)
    # truncation (TIS) keeps every token: it only clips the weights
    tis = RolloutCorrectionConfig(rollout_is="token", rollout_is_mode="truncate", rollout_is_threshold=2.0)
    assert kept_token_fraction(LossConfig(rollout_correction=tis), old, rollout, mask) == 1.0


def test_geo_rs_on_a_mismatched_batch_keeps_only_the_matching_rows():
    from fp8rl_jax.objectives import LossConfig, RolloutCorrectionConfig
    from fp8rl_jax.trainer.correction_watch import kept_token_fraction

    # decoupled_geo_rs rejects a row whose geometric-mean ratio leaves [0.999, 1.001]
    old, rollout, mask = _batch([0.0, 0.02, -0.02, 0.0], [6, 5, 4, 3])
    cfg = LossConfig(rollout_correction=RolloutCorrectionConfig.decoupled_geo_rs())
    want = (6 + 3) / (6 + 5 + 4 + 3)
    assert math.isclose(kept_token_fraction(cfg, old, rollout, mask), want, abs_tol=1e-6)
    old, rollout, mask = _batch([0.05, -0.05, 0.1], [6, 6, 6])  # every row off by more than 0.1%: nothing kept
    assert kept_token_fraction(cfg, old, rollout, mask) == 0.0


def test_the_watch_warns_once_after_the_set_number_of_consecutive_steps():
    from fp8rl_jax.trainer.correction_watch import KeptFractionWatch

    w = KeptFractionWatch(0.05, 3)
    assert w.update(1, 0.0) is None and w.update(2, 0.01) is None
    assert w.update(3, 0.5) is None  # a good step resets the count
    assert w.update(4, 0.0) is None and w.update(5, float("nan")) is None and w.update(6, 0.02) is None
    msg = w.update(7, 0.0)
    assert msg is not None and "\n" not in msg
    assert "train.min_kept_fraction=0.05" in msg and "train.min_kept_fraction_steps" in msg and "step 7" in msg
    assert "0.0%, 2.0%, 0.0%" in msg  # the three fractions that triggered it
    assert w.update(8, 0.0) is None and w.update(9, 0.0) is None  # once
    off = KeptFractionWatch(0.0, 1)
    assert all(off.update(i, 0.0) is None for i in range(5))


def test_the_trainer_warns_when_its_correction_drops_everything():
    """The trainer's own check (RLTrainer.check_kept_fraction) called on a batch, without a model: a strict
    correction that keeps no token warns on the train.min_kept_fraction_steps-th step, once, and logs the metric."""
    import jax.numpy as jnp

    from fp8rl_jax.objectives import LossConfig, RolloutCorrectionConfig
    from fp8rl_jax.trainer import RLTrainer, TrainConfig
    from fp8rl_jax.trainer.correction_watch import KeptFractionWatch

    cfg = TrainConfig(min_kept_fraction=0.05, min_kept_fraction_steps=2)
    stub = types.SimpleNamespace(loss_config=LossConfig(rollout_correction=RolloutCorrectionConfig.decoupled_geo_rs()),
                                 _kept_watch=KeptFractionWatch(cfg.min_kept_fraction, cfg.min_kept_fraction_steps),
                                 step_count=0)
    old, rollout, mask = _batch([0.05, -0.05], [6, 6])
    batch = {"old_logprobs": jnp.asarray(old), "rollout_logprobs": jnp.asarray(rollout),
             "response_mask": jnp.asarray(mask), "advantages": jnp.zeros((2,), jnp.float32)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fractions = []
        for step in range(4):
            stub.step_count = step
            fractions.append(RLTrainer.check_kept_fraction(stub, batch))
    assert fractions == [0.0] * 4
    ours = [w for w in caught if "min_kept_fraction" in str(w.message)]
    assert len(ours) == 1 and issubclass(ours[0].category, RuntimeWarning)
    assert "step 2:" in str(ours[0].message)  # the second step below the threshold (metrics' 1-based numbering)


def test_min_kept_fraction_is_validated():
    from fp8rl_jax.trainer import TrainConfig

    with pytest.raises(ValueError, match="train.min_kept_fraction"):
        TrainConfig(min_kept_fraction=1.5)
    with pytest.raises(ValueError, match="train.min_kept_fraction_steps"):
        TrainConfig(min_kept_fraction_steps=0)


# ---------------------------------------------------------------------------------------------------------------
# 14. partial rollouts that never cut
# ---------------------------------------------------------------------------------------------------------------
def _partial(**kw):
    from fp8rl_jax.trainer import TrainConfig

    return TrainConfig(max_staleness=1, async_schedule="latest", partial_rollout=True, **kw)


def test_partial_rollout_chunks_at_least_the_budget_warn():
    for tokens, budget in ((32, 16), (16, 16), (40, 32)):
        (msg,) = _partial(partial_rollout_tokens=tokens, max_tokens=budget).start_warnings()
        assert "\n" not in msg
        assert f"train.partial_rollout_tokens={tokens}" in msg and f"response budget {budget}" in msg
        assert "train.partial_rollout=False" in msg
    assert _partial(partial_rollout_tokens=8, max_tokens=16).start_warnings() == []
    # the budget is max_response_length where it is set
    assert _partial(partial_rollout_tokens=32, max_response_length=64).start_warnings() == []
    assert len(_partial(partial_rollout_tokens=64, max_response_length=64).start_warnings()) == 1
    from fp8rl_jax.trainer import TrainConfig

    assert TrainConfig(partial_rollout_tokens=1000, max_tokens=16).start_warnings() == []  # partial rollout off


def test_the_trainer_warns_at_start_before_loading_anything(tmp_path):
    from fp8rl_jax.trainer import RLTrainer

    cfg = _partial(partial_rollout_tokens=32, max_tokens=16, model=str(tmp_path / "no_such_model"),
                   output_dir=str(tmp_path / "run"))
    with pytest.warns(UserWarning, match="partial_rollout_tokens=32 >= the response budget 16"):
        with pytest.raises(FileNotFoundError):  # the warning came first: the model load fails after it
            RLTrainer(cfg)


# ---------------------------------------------------------------------------------------------------------------
# 10. the closing TensorBoard line
# ---------------------------------------------------------------------------------------------------------------
def test_tensorboard_line_says_what_to_install_when_the_viewer_is_missing(monkeypatch):
    import importlib.util

    from fp8rl_jax.trainer import run

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    line = run.tensorboard_command("/r/tensorboard")
    assert line.startswith("tensorboard --logdir /r/tensorboard")
    assert f"{sys.executable} -m pip install tensorboard" in line


def test_tensorboard_line_is_a_command_that_runs_where_the_viewer_is_installed(monkeypatch, tmp_path):
    import importlib.util
    import shutil

    from fp8rl_jax.trainer import run

    fake = types.SimpleNamespace(name="tensorboard")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: fake if name == "tensorboard" else real(name, *a))
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/tensorboard")
    assert run.tensorboard_command("/r/tb") == "tensorboard --logdir /r/tb"
    # installed in this interpreter's environment, which is not on PATH: the script's full path
    venv_bin = tmp_path / "bin"
    venv_bin.mkdir()
    (venv_bin / "tensorboard").write_text("#!/bin/sh\n")
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setattr(sys, "executable", str(venv_bin / "python"))
    line = run.tensorboard_command("/r/tb")
    assert line.startswith(f"{venv_bin / 'tensorboard'} --logdir /r/tb") and "tensorboard --logdir /r/tb" in line


def test_tensorboard_line_matches_this_environment():
    """No monkeypatching: whatever this environment has, the line is either runnable or says what to install."""
    import importlib.util

    from fp8rl_jax.trainer import run

    line = run.tensorboard_command("/r/tb")
    if importlib.util.find_spec("tensorboard") is None:
        assert "pip install tensorboard" in line
    else:
        assert "pip install" not in line and os.path.basename(line.split(" ")[0]) == "tensorboard"
