"""Training precision: bf16 / fp16 (dynamic loss scaling, overflow-skip) / fp8 (blockwise FP8 forward, custom VJP).

References: a float64 numpy re-statement of PyTorch ``GradScaler.update`` for the loss-scale trajectory; the
float32 trainer for bf16/fp16 numerics; the rollout engine's independent FP8 W8A8 model (pre-quantized e4m3
weights + ``w8a8_block_matmul``) for the FP8 training forward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from conftest import make_tiny_run_dir
from fp8rl_jax.trainer import RLTrainer, TrainConfig
from fp8rl_jax.trainer.logprobs import response_logprobs
from fp8rl_jax.trainer.precision import (LossScaleConfig, adjust_loss_scale, all_finite, apply_train_precision,
                                         compute_dtype, init_loss_scale, unscale, wrap_optimizer)


def test_loss_scale_follows_gradscaler_rules():
    cfg = LossScaleConfig(init_scale=2.0**10, growth_factor=2.0, backoff_factor=0.5, growth_interval=3,
                          min_scale=1.0, max_scale=2.0**12)
    flags = np.random.default_rng(0).random(60) > 0.25
    flags[:20] = True  # long finite run: hits max_scale
    flags[20:34] = False  # long overflow run: hits min_scale
    # reference (float64): GradScaler.update with a growth tracker
    scale, good, ref = 2.0**10, 0, []
    for f in flags:
        if f:
            good += 1
            if good == 3:
                scale, good = min(scale * 2.0, 2.0**12), 0
        else:
            scale, good = max(scale * 0.5, 1.0), 0
        ref.append((scale, good))
    step = jax.jit(lambda s, f: adjust_loss_scale(s, f, cfg))
    st = init_loss_scale(cfg)
    for f, (rs, rg) in zip(flags, ref):
        st = step(st, jnp.asarray(f))
        assert (float(st["scale"]), int(st["good_steps"])) == (rs, rg)
    assert max(s for s, _ in ref) == 2.0**12 and min(s for s, _ in ref) == 1.0
    g = {"a": jnp.asarray([2.0, -4.0], jnp.float16), "b": jnp.asarray([8.0], jnp.float32)}
    u = unscale(g, {"scale": jnp.float32(4.0)})
    np.testing.assert_array_equal(np.asarray(u["a"], np.float64), [0.5, -1.0])
    assert u["a"].dtype == jnp.float16 and float(u["b"][0]) == 2.0
    assert bool(all_finite(g)) and not bool(all_finite({"x": jnp.asarray([1.0, jnp.inf])}))
    assert not bool(all_finite({"x": jnp.asarray([jnp.nan])}))
    with pytest.raises(ValueError, match="backoff_factor"):
        LossScaleConfig(backoff_factor=1.5)


def test_precision_is_one_gin_line_and_bad_values_are_named():
    import gin

    try:
        gin.parse_config(['train.train_precision = "fp16"'])
        assert TrainConfig().train_precision == "fp16"
    finally:
        gin.clear_config()
    with pytest.raises(ValueError, match=r"train_precision='fp4'"):
        TrainConfig(train_precision="fp4")
    with pytest.raises(ValueError, match="fp4"):
        compute_dtype("fp4")
    assert [compute_dtype(p) for p in ("float32", "bf16", "fp16", "fp8")] == ["float32", "bfloat16", "float16",
                                                                              "bfloat16"]
    assert wrap_optimizer(tx := optax.sgd(0.1), "bf16") is tx


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_run_dir(tmp_path_factory.mktemp("tiny_prec"))


@pytest.fixture(scope="module")
def batch():
    """A fixed synthetic RL batch: 4 rows, prompt 8 tokens (left-padded), 6 response tokens."""
    r = np.random.default_rng(1)
    pmask = np.ones((4, 8), bool)
    pmask[1, :3] = False
    rmask = np.ones((4, 6), np.float32)
    rmask[2, 4:] = 0
    return {"prompt_ids": jnp.asarray(r.integers(3, 259, (4, 8)), jnp.int32), "prompt_mask": jnp.asarray(pmask),
            "response_ids": jnp.asarray(r.integers(3, 259, (4, 6)), jnp.int32),
            "response_mask": jnp.asarray(rmask),
            "rollout_logprobs": jnp.asarray(-r.uniform(4.0, 7.0, (4, 6)), jnp.float32),
            "advantages": jnp.asarray([1.0, -1.0, 0.5, -0.5], jnp.float32)}


_TRAINERS: dict = {}


def _trainer(tiny_dir, precision, rollout="float32", **kw):
    key = (precision, rollout, tuple(sorted(kw.items())))
    if key not in _TRAINERS:
        cfg = TrainConfig(output_dir="/tmp/unused", model=tiny_dir, prompts_per_step=2, samples_per_prompt=2,
                          max_tokens=6, rollout_precision=rollout, train_precision=precision, learning_rate=1e-2,
                          progress_bar=False, **kw)
        _TRAINERS[key] = RLTrainer(cfg)
    return _TRAINERS[key]


def _grads(tr, batch):
    def loss(model):
        lp = response_logprobs(model, batch["prompt_ids"], batch["prompt_mask"], batch["response_ids"])
        return jnp.sum(lp * batch["response_mask"] * batch["advantages"][:, None])

    g = nnx.grad(loss)(tr.model)
    return {".".join(map(str, p)): np.asarray(v[...], np.float64) for p, v in nnx.to_flat_state(g)}


def _cos(a, b):
    a, b = np.concatenate([x.ravel() for x in a]), np.concatenate([x.ravel() for x in b])
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_bf16_and_fp8_numerics_against_references(tiny_dir, batch):
    f32 = _trainer(tiny_dir, "float32")
    lp32 = np.asarray(response_logprobs(f32.model, batch["prompt_ids"], batch["prompt_mask"], batch["response_ids"]))
    g32 = _grads(f32, batch)
    # bf16: float32 masters, bfloat16 compute; logprobs/grad direction close to float32
    b16 = _trainer(tiny_dir, "bf16")
    assert b16.model.model.layers[0].mlp.up_proj.weight[...].dtype == jnp.float32
    assert b16.model.dtype == jnp.bfloat16
    lpb = np.asarray(response_logprobs(b16.model, batch["prompt_ids"], batch["prompt_mask"], batch["response_ids"]))
    assert not np.array_equal(lpb, lp32) and np.max(np.abs(lpb - lp32)) < 0.1
    gb = _grads(b16, batch)
    assert _cos([gb[k] for k in g32], [g32[k] for k in g32]) > 0.99
    # fp8: every decoder linear runs the FP8 training product; its forward equals the rollout engine's
    # independent W8A8 blockwise model built from the exported e4m3 weights + weight_scale_inv
    f8 = _trainer(tiny_dir, "fp8", rollout="fp8")
    lin = f8.model.model.layers[1].self_attn.q_proj
    assert lin.dot_general is not None and "bf16" in lin.dot_general.__doc__ and f8.model.lm_head.dot_general is None
    lp8 = np.asarray(response_logprobs(f8.model, batch["prompt_ids"], batch["prompt_mask"], batch["response_ids"]))
    eng = np.asarray(response_logprobs(f8.engine.model, batch["prompt_ids"], batch["prompt_mask"],
                                       batch["response_ids"]))
    np.testing.assert_allclose(lp8, eng, atol=2e-2)
    assert np.max(np.abs(lp8 - lp32)) > np.max(np.abs(lp8 - eng))  # closer to FP8 rollout than to float32
    g8 = _grads(f8, batch)
    assert all(np.all(np.isfinite(v)) for v in g8.values())
    assert _cos([g8[k] for k in g32], [g32[k] for k in g32]) > 0.95
    with pytest.raises(ValueError, match="fp4"):
        apply_train_precision(f8.model, "fp4")


def test_fp8_training_leaves_the_moe_router_dense():
    """FP8 training puts its product on exactly the linears the FP8 export quantizes: Qwen3-MoE experts and
    attention get it, the router ``mlp.gate`` (unquantized in the export, as in verl) keeps the plain product."""
    from fp8rl_jax.export import is_quantized_linear
    from fp8rl_jax.models.decoder import CausalLM
    from fp8rl_jax.models.moe import tiny_qwen3_moe_config

    model = CausalLM(tiny_qwen3_moe_config(64), dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    dg = apply_train_precision(model, "fp8")
    assert dg is not None and not is_quantized_linear("model.layers.0.mlp.gate.weight")
    for layer in model.model.layers:
        assert layer.mlp.gate.dot_general is None  # router: plain einsum, never FP8
        assert layer.self_attn.q_proj.dot_general is dg
        e = layer.mlp.experts  # the stacked experts' projections (fp8rl_jax.models.experts)
        assert e.gate_proj.dot_general is e.up_proj.dot_general is e.down_proj.dot_general is dg
    assert model.lm_head.dot_general is None


def test_fp16_overflow_skips_the_step_and_halves_the_scale(tiny_dir, batch):
    """A huge loss scale overflows float16 cotangents: the update is skipped (params, optax state unchanged)
    and the scale halves; with a sane scale the fp16 update matches the float32 trainer's."""
    from fp8rl_jax.trainer.checkpoint import load_model_state, load_optimizer_state, model_state, optimizer_state

    tr = _trainer(tiny_dir, "fp16", loss_scale_init=2.0**40, loss_scale_growth_interval=2)
    assert tr.model.dtype == jnp.float16
    # a snapshot, not references: the train step donates the model's and optimizer's buffers (deleted by it)
    init = jax.tree.map(jnp.copy, (model_state(tr.model), optimizer_state(tr.optimizer)))
    before = {k: np.asarray(v[...]) for k, v in nnx.to_flat_state(nnx.state(tr.model, nnx.Param))}
    m, _ = tr._train_step(tr.model, tr.optimizer, batch, True)
    assert float(m["actor/skipped_step"]) == 1.0 and float(m["actor/loss_scale"]) == 2.0**40
    assert float(tr.optimizer.loss_scale[...]) == 2.0**39
    for k, v in nnx.to_flat_state(nnx.state(tr.model, nnx.Param)):
        np.testing.assert_array_equal(np.asarray(v[...]), before[k])
    assert int(tr.optimizer.opt_state.total_notfinite[...]) == 1
    tr.optimizer.loss_scale[...] = jnp.float32(2.0**8)
    m, _ = tr._train_step(tr.model, tr.optimizer, batch, True)
    assert float(m["actor/skipped_step"]) == 0.0 and int(tr.optimizer.loss_scale_good_steps[...]) == 1
    m, _ = tr._train_step(tr.model, tr.optimizer, batch, True)  # second finite step in a row: growth
    assert float(tr.optimizer.loss_scale[...]) == 2.0**9
    # reference: the float32 trainer's first update from the same weights and batch
    ref = _trainer(tiny_dir, "float32")
    p0 = {k: np.asarray(v[...]) for k, v in nnx.to_flat_state(nnx.state(ref.model, nnx.Param))}
    ref._train_step(ref.model, ref.optimizer, batch, True)
    d_ref = {k: np.asarray(v[...]) - p0[k] for k, v in nnx.to_flat_state(nnx.state(ref.model, nnx.Param))}
    load_model_state(tr.model, init[0])  # back to the initial weights and optimizer state, sane scale
    load_optimizer_state(tr.optimizer, init[1])
    tr.optimizer.loss_scale[...] = jnp.float32(2.0**8)
    tr._train_step(tr.model, tr.optimizer, batch, True)
    d16 = {k: np.asarray(v[...]) - p0[k] for k, v in nnx.to_flat_state(nnx.state(tr.model, nnx.Param))}
    assert _cos([d16[k] for k in d_ref], [d_ref[k] for k in d_ref]) > 0.99
