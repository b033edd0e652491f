"""Content check of every weight sync (train.verify_sync) on the embedded engine, and the mismatch bound.

The check's reference is the trainer's own forward; what it must catch are syncs that report success but leave the
engine serving something else: (a) a sync that writes nothing, (b) one that writes only some layers, (c) KV scales
reset to 1.0. The per-token comparison is checked against a float64 numpy transcription of its definition.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import make_tiny_smollm2_vocab_dir
from fp8rl_jax.models.decoder import load_named_params, named_params
from fp8rl_jax.rollout import verify
from fp8rl_jax.rollout.engine import StaleWeightsError


def _trainer(path, **kw):
    from fp8rl_jax.trainer import RLTrainer, TrainConfig

    cfg = TrainConfig(output_dir=str(path / "run"), model=str(path / "model"), num_steps=1, prompts_per_step=2,
                      samples_per_prompt=2, max_tokens=4, checkpoint_every=0, plots=False, progress_bar=False, **kw)
    return RLTrainer(cfg)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("verify")
    make_tiny_smollm2_vocab_dir(d / "model")
    return d


def _perturb(trainer, std=0.5, seed=0, layers=None):
    """Add N(0, std) to the trainer's 2-D weights (of ``layers`` only, when given): a large, real update."""
    rng = np.random.default_rng(seed)
    new = {}
    for k, v in named_params(trainer.model).items():
        hit = v.ndim == 2 and (layers is None or any(f"layers.{i}." in k for i in layers))
        new[k] = v + jnp.asarray(rng.normal(0, std, v.shape), v.dtype) if hit else v
    load_named_params(trainer.model, new)


def test_correct_syncs_pass_and_report_the_difference(model_dir):
    for prec in ("fp8", "bf16", "float32"):
        tr = _trainer(model_dir, rollout_precision=prec)
        assert 0 <= tr.last_probe_diff <= verify.probe_tolerance(prec)  # the initial sync was checked
        m = tr.step()
        assert 0 <= m["sync/probe_abs_diff"] <= verify.probe_tolerance(prec) and m["timing/verify_sync_s"] > 0
    # float32 engine vs float32 trainer on the same weights: only float32 rounding differs (the trainer takes
    # z - logsumexp(z) per logits chunk and XLA attention without a cache; the engine log_softmax through its cache)
    assert tr.last_probe_diff < 1e-5


def test_a_sync_that_writes_nothing_is_caught(model_dir):
    tr = _trainer(model_dir, rollout_precision="fp8")
    _perturb(tr)
    tr.engine.update_weights = lambda w: None  # reports success, writes nothing
    with pytest.raises(StaleWeightsError, match=r"all weights.*wrote nothing"):
        tr.verify_sync()


def test_a_sync_that_writes_only_some_layers_is_caught(model_dir):
    tr = _trainer(model_dir, rollout_precision="bf16")
    old = tr.export()
    _perturb(tr)
    new = tr.export()
    partial = {k: (old.tensors[k] if ".layers.1." in k else v) for k, v in new.tensors.items()}
    tr.engine.update_weights(dataclasses.replace(new, tensors=partial))
    with pytest.raises(StaleWeightsError, match="decoder layers"):
        tr.verify_sync()
    tr.engine.update_weights(new)  # the full sync passes
    assert tr.verify_sync() <= verify.probe_tolerance("bf16")


def test_an_untouched_output_projection_is_named(model_dir):
    """Engine logits ~0 (as vLLM's stale packed lm_head gave): uniform logprobs, named as lm_head."""
    tr = _trainer(model_dir, rollout_precision="bf16")
    _perturb(tr, std=1.0)
    w = tr.export()
    w.tensors["model.embed_tokens.weight"] = jnp.zeros_like(w.tensors["model.embed_tokens.weight"])
    tr.engine.update_weights(w)
    with pytest.raises(StaleWeightsError, match="lm_head"):
        tr.verify_sync()


def test_kv_scales_reset_to_one_are_caught(model_dir):
    from fp8rl_jax.fp8.kv_cache import KVScales

    tr = _trainer(model_dir, rollout_precision="fp8", kv_cache_dtype="fp8_e4m3")
    assert tr.last_probe_diff <= verify.probe_tolerance("fp8", "fp8_e4m3")
    n = tr.model_config.num_hidden_layers
    tr.engine.set_kv_scales(KVScales(*(np.ones(n, np.float32),) * 3), tr.engine.kv_scales_version)
    with pytest.raises(StaleWeightsError, match=r"KV-cache scales of layers \[0, 1\].*reset to 1.0"):
        tr.verify_sync()


def test_verify_sync_modes_and_an_engine_without_score(model_dir):
    tr = _trainer(model_dir, rollout_precision="bf16", verify_sync="first")
    assert np.isfinite(tr.last_probe_diff)
    assert math.isnan(tr.step()["sync/probe_abs_diff"])  # later syncs unchecked
    off = _trainer(model_dir, rollout_precision="bf16", verify_sync="off")
    assert math.isnan(off.last_probe_diff)
    off.engine = object()  # an injected engine without score(): not checked, said once
    with pytest.warns(RuntimeWarning, match="no score"):
        assert math.isnan(off.verify_sync())
    from fp8rl_jax.trainer import TrainConfig

    with pytest.raises(ValueError, match="verify_sync"):
        TrainConfig(verify_sync="always")


def test_check_probe_matches_its_numpy_definition():
    rng = np.random.default_rng(0)
    ref = [rng.normal(-3, 1, 5), rng.normal(-3, 1, 3)]
    eng = [r + rng.normal(0, 0.01, r.shape) for r in ref]
    want = np.mean(np.abs(np.concatenate(eng).astype(np.float64) - np.concatenate(ref)))
    assert verify.check_probe(eng, ref, tolerance=0.1, version=1, vocab_size=100) == pytest.approx(want, rel=1e-12)
    with pytest.raises(StaleWeightsError, match="not finite"):
        verify.check_probe([np.full(5, np.nan), np.zeros(3)], ref, tolerance=0.1, version=1, vocab_size=100)
    with pytest.raises(StaleWeightsError, match="lm_head"):
        verify.check_probe([np.full(5, -math.log(100)), np.full(3, -math.log(100))], ref, tolerance=0.1, version=1,
                           vocab_size=100)


def test_mismatch_bound_warns_or_stops(model_dir):
    tr = _trainer(model_dir, rollout_precision="fp8")
    bound = verify.mismatch_bound("fp8")
    tr.check_mismatch({"rollout_corr/k3_kl": bound / 2})  # quiet below the bound
    with pytest.warns(RuntimeWarning, match="k3_kl = 4.13 exceeds.*Likely causes"):
        tr.check_mismatch({"rollout_corr/k3_kl": 4.13})
    stop = _trainer(model_dir, rollout_precision="fp8", mismatch_action="raise", max_k3_kl=0.5)
    with pytest.raises(RuntimeError, match="exceeds 0.5"):
        stop.check_mismatch({"rollout_corr/k3_kl": 0.6})
