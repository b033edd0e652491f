"""Qwen3-MoE: logits parity with ``transformers``, routing vs a float64 formula, FP8 experts vs per-expert W8A8,
export names vs vLLM's own expert-params mapping, and 2 RL steps with FP8 rollout on a tiny random MoE."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from flax import nnx

from conftest import make_hf_model
from fp8rl_jax.export import export_weights, is_quantized_linear
from fp8rl_jax.fp8 import E4M3, dequantize_weight_blockwise, quantize_weight_blockwise
from fp8rl_jax.models.config import ModelConfig, hf_param_shapes
from fp8rl_jax.models.decoder import named_params
from fp8rl_jax.models.hf_io import load_hf_dir, save_hf_dir
from fp8rl_jax.models.loading import build_model
from fp8rl_jax.models.moe import SparseMoeBlock, route_top_k, tiny_qwen3_moe_config, write_tiny_qwen3_moe

torch = pytest.importorskip("torch", reason="needs the [test] extra (torch)")


def _np(x):
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


# -- parity with transformers ---------------------------------------------------------------------------------


@pytest.mark.parametrize("moe_kw", [
    dict(norm_topk_prob=True),                                            # every layer sparse, renormalised
    dict(norm_topk_prob=False, mlp_only_layers=[0], num_experts_per_tok=3),  # layer 0 dense, raw top-3 probs
])
def test_moe_logits_match_transformers(tmp_path, moe_kw):
    """float32 logits of our Qwen3-MoE vs transformers' Qwen3MoeForCausalLM on the same random weights; the
    checkpoint we write back loads into transformers with the same logits (names + config round-trip)."""
    import transformers

    hf = make_hf_model("qwen3_moe", **moe_kw)
    hf.save_pretrained(tmp_path / "src")
    cfg, params, raw = load_hf_dir(str(tmp_path / "src"))
    assert cfg.model_type == "qwen3_moe" and cfg.qk_norm
    assert cfg.num_experts == raw.get("num_experts", raw.get("num_local_experts")) == 4
    assert cfg.norm_topk_prob == moe_kw["norm_topk_prob"]
    assert [cfg.is_sparse_layer(i) for i in range(2)] == [hf.model.layers[i].mlp.__class__.__name__
                                                         == "Qwen3MoeSparseMoeBlock" for i in range(2)]
    shapes = hf_param_shapes(cfg)
    assert shapes == {k: tuple(v.shape) for k, v in params.items()}  # per-expert checkpoint names, HF on disk
    model = build_model(cfg, params)
    assert set(named_params(model)) == set(shapes)
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (3, 17))
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    out = np.asarray(model(jnp.asarray(ids)))
    assert np.abs(out - ref).max() < 1e-4
    # the routing is not degenerate: tokens pick different experts
    x = jnp.asarray(np.random.default_rng(2).normal(size=(32, cfg.hidden_size)), jnp.float32)
    sparse = next(l.mlp for l in model.model.layers if isinstance(l.mlp, SparseMoeBlock))
    assert len(np.unique(np.asarray(sparse.router(x)[2]))) == cfg.num_experts

    save_hf_dir(str(tmp_path / "out"), cfg, named_params(model))
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    with torch.no_grad():
        assert np.abs(back(torch.tensor(ids)).logits.numpy() - ref).max() < 1e-6


# -- routing and experts vs independent float64 references -------------------------------------------------


def _route_f64(logits, k, norm):
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ids = np.argsort(-p, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(p, ids, -1)
    return (w / w.sum(-1, keepdims=True) if norm else w), ids


@pytest.mark.parametrize("norm", [True, False])
def test_route_top_k_matches_float64_formula(norm):
    logits = np.random.default_rng(3).normal(size=(64, 8)) * 3
    w, ids = route_top_k(jnp.asarray(logits, jnp.float32), 3, norm)
    rw, rids = _route_f64(logits, 3, norm)
    assert (np.asarray(ids) == rids).all()
    assert np.abs(np.asarray(w) - rw).max() < 1e-6
    with pytest.raises(ValueError, match="top_k=9"):
        route_top_k(jnp.asarray(logits), 9, norm)


@pytest.fixture(scope="module")
def moe_cfg():
    return tiny_qwen3_moe_config(256, hidden_size=160, moe_intermediate_size=192, num_experts=6,
                                 num_experts_per_tok=2)  # K=160, N=192: partial 128-blocks on both axes


def test_sparse_block_matches_float64_loop(moe_cfg):
    """Grouped (ragged_dot) expert compute == a per-token float64 loop over the selected experts."""
    blk = SparseMoeBlock(moe_cfg, linear_precision="dense", param_dtype=jnp.float32, dtype=jnp.float32,
                         rngs=nnx.Rngs(0))
    blk.gate.weight[...] = blk.gate.weight[...] * 20  # spread the router so top-2 is well separated
    x = np.random.default_rng(4).normal(size=(2, 9, moe_cfg.hidden_size))
    fwd = nnx.jit(lambda m, v: m(v))
    out = np.asarray(fwd(blk, jnp.asarray(x, jnp.float32)))
    xt = x.reshape(-1, x.shape[-1])
    w, ids = _route_f64(xt @ _np(blk.gate.weight[...]).T, moe_cfg.num_experts_per_tok, True)
    ref = np.zeros_like(xt)
    silu = lambda v: v / (1 + np.exp(-v))  # noqa: E731
    for t in range(len(xt)):
        for slot in range(ids.shape[1]):
            e, j = blk.experts, int(ids[t, slot])
            h = silu(_np(e.gate_proj.weight[...][j]) @ xt[t]) * (_np(e.up_proj.weight[...][j]) @ xt[t])
            ref[t] += w[t, slot] * (_np(e.down_proj.weight[...][j]) @ h)
    assert np.abs(out.reshape(xt.shape) - ref).max() < 1e-5 * max(1.0, np.abs(ref).max())
    # with a training-precision dot_general set on the experts (trainer/precision.py) the tiled path runs with it;
    # with a plain lax.dot_general it computes the same values
    e = blk.experts
    for lin in (e.gate_proj, e.up_proj, e.down_proj):
        lin.dot_general = jax.lax.dot_general
    out_dg = np.asarray(fwd(blk, jnp.asarray(x, jnp.float32)))
    assert np.abs(out_dg.reshape(xt.shape) - ref).max() < 1e-5 * max(1.0, np.abs(ref).max())
    for lin in (e.gate_proj, e.up_proj, e.down_proj):
        lin.dot_general = None
    # gradients flow to the router and to the selected experts only
    grads = nnx.jit(nnx.grad(lambda m: jnp.sum(m(jnp.asarray(x, jnp.float32)) ** 2)))(blk)
    used = set(ids.ravel().tolist())
    for j in range(moe_cfg.num_experts):
        gnorm = float(jnp.abs(grads.experts.up_proj.weight[...][j]).max())
        assert (gnorm > 0) == (j in used)
    assert float(jnp.abs(grads.gate.weight[...]).max()) > 0


def test_fp8_experts_match_per_expert_w8a8_linear(moe_cfg):
    """FP8 experts through the grouped path == each selected expert's own FP8 ``Linear`` (w8a8_block_matmul),
    with the same bf16-free float32 routing; router stays dense."""
    dense = SparseMoeBlock(moe_cfg, linear_precision="dense", param_dtype=jnp.float32, dtype=jnp.float32,
                           rngs=nnx.Rngs(1))
    fp8 = SparseMoeBlock(moe_cfg, linear_precision="fp8", param_dtype=jnp.float32, dtype=jnp.float32,
                         rngs=nnx.Rngs(1))
    assert fp8.gate.precision == "dense"
    for name in ("gate_proj", "up_proj", "down_proj"):  # the [E, N, K] stacks, quantized per expert
        q, s = quantize_weight_blockwise(getattr(dense.experts, name).weight[...])
        getattr(fp8.experts, name).weight[...] = q
        getattr(fp8.experts, name).weight_scale_inv[...] = s
    dense.gate.weight[...] = dense.gate.weight[...] * 20
    fp8.gate.weight[...] = dense.gate.weight[...]
    assert fp8.experts.gate_proj.weight[...].dtype == E4M3
    x = jnp.asarray(np.random.default_rng(5).normal(size=(13, moe_cfg.hidden_size)), jnp.float32)
    call = nnx.jit(lambda m, v: m(v))
    out = np.asarray(call(fp8, x), np.float64)
    _, w, ids = fp8.router(x)
    one = nnx.jit(lambda m, v, j: m.expert(j, v), static_argnums=2)
    per_expert = {j: _np(one(fp8.experts, x, j)) for j in set(np.asarray(ids).ravel().tolist())}  # all tokens
    ref = np.zeros(out.shape)
    for t in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            ref[t] += float(w[t, slot]) * per_expert[int(ids[t, slot])][t]
    assert np.abs(out - ref).max() < 1e-5 * np.abs(ref).max()
    # and FP8 is close to (not equal to) the dense experts: e4m3 error, a few percent
    fp8_vs_dense = np.abs(out - _np(call(dense, x))).max() / np.abs(ref).max()
    assert 1e-4 < fp8_vs_dense < 0.1


# -- export names vs vLLM ---------------------------------------------------------------------------------------


def test_fp8_export_names_match_vllm_expert_mapping():
    """Exported expert tensors use the per-expert checkpoint names that vLLM's FusedMoE loader maps to its fused
    ``w13``/``w2`` params (read from vLLM's own ``RoutedExperts.build_expert_params_mapping``); the router
    ``mlp.gate`` stays bf16 with no scale."""
    cfg = tiny_qwen3_moe_config(256, num_experts=4)
    model = build_model(cfg)
    exp = export_weights(named_params(model), "fp8_blockwise").tensors
    router = [k for k in exp if k.endswith("mlp.gate.weight")]
    assert len(router) == cfg.num_hidden_layers and not is_quantized_linear(router[0])
    assert all(exp[k].dtype == jnp.bfloat16 and k + "_scale_inv" not in exp for k in router)
    expert_keys = [k for k in exp if ".mlp.experts." in k]
    assert len(expert_keys) == cfg.num_hidden_layers * cfg.num_experts * 3 * 2
    for k in expert_keys:
        if k.endswith(".weight"):
            assert exp[k].dtype == E4M3 and exp[k].shape == hf_param_shapes(cfg)[k]

    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    # Qwen3-MoE's FusedMoE builds its mapping with routed_experts_prefix="" (RoutedExperts.get_expert_mapping)
    mapping = RoutedExperts.build_expert_params_mapping("gate_proj", "down_proj", "up_proj",
                                                        num_experts=cfg.num_experts, routed_experts_prefix="")
    want_shard = {"gate_proj": ("experts.w13_", "w1"), "up_proj": ("experts.w13_", "w3"),
                  "down_proj": ("experts.w2_", "w2")}
    for k in expert_keys:
        hits = [m for m in mapping if m[1] in k]
        assert len(hits) == 1, (k, hits)
        param_prefix, weight_name, expert_id, shard = hits[0]
        j, proj = k.split(".mlp.experts.")[1].split(".")[:2]
        assert expert_id == int(j) and (param_prefix, shard) == want_shard[proj]
        vllm_param = k.replace(weight_name, param_prefix).split(".mlp.")[1]
        suffix = "weight_scale_inv" if k.endswith("_scale_inv") else "weight"
        assert vllm_param == f"{param_prefix}{suffix}"  # experts.w13_weight_scale_inv: vLLM's block-FP8 MoE name
    import inspect

    from vllm.model_executor.layers.quantization import fp8 as vllm_fp8

    # vLLM's block-FP8 MoE method names its expert scales weight_scale_inv (-> w13_weight_scale_inv, w2_...)
    src = inspect.getsource(vllm_fp8.Fp8MoEMethod).replace("'", '"')
    assert '"weight_scale_inv" if self.block_quant' in src


# -- two RL steps, FP8 rollout ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_qwen3_moe"))
    write_tiny_qwen3_moe(path)
    return path


def test_tiny_moe_dir_round_trips(tiny_moe_dir):
    cfg, params, _ = load_hf_dir(tiny_moe_dir)
    assert cfg == ModelConfig.from_hf_dict(cfg.to_hf_dict())
    assert {k: tuple(v.shape) for k, v in params.items()} == hf_param_shapes(cfg)


def test_two_rl_steps_tiny_moe_fp8_rollout(tiny_moe_dir):
    from fp8rl_jax.trainer import TrainConfig
    from fp8rl_jax.trainer.loop import RLTrainer

    cfg = TrainConfig(output_dir="/dev/null", model=tiny_moe_dir, num_steps=2, prompts_per_step=2,
                      samples_per_prompt=2, max_tokens=4, rollout_precision="fp8", learning_rate=1e-2,
                      progress_bar=False)
    trainer = RLTrainer(cfg)
    # A random model never solves chain_sum (reward 0 -> advantages 0 -> no update); reward the response length
    # instead so that GRPO advantages, gradients and the weight sync are exercised.
    trainer.reward_fn = lambda text, item: float(len(text)) / 16
    before = {k: np.asarray(v) for k, v in named_params(trainer.model).items()}
    for _ in range(2):
        m = trainer.step()
        assert np.isfinite(m["actor/loss"]) and np.isfinite(m["actor/grad_norm"])
    after = named_params(trainer.model)
    e0 = "model.layers.0.mlp.experts.0.gate_proj.weight"
    r0 = "model.layers.0.mlp.gate.weight"
    assert np.abs(np.asarray(after[r0]) - before[r0]).max() > 0
    assert any(np.abs(np.asarray(after[k]) - before[k]).max() > 0 for k in after if ".mlp.experts." in k)
    # synced: the engine holds step-2 weights, experts in e4m3 within the blockwise bound, router in bf16
    eng = named_params(trainer.engine.model)
    assert trainer.engine.weights_version == 2
    for k in (e0, "model.layers.1.mlp.experts.3.down_proj.weight"):
        assert eng[k].dtype == E4M3
        deq = _np(dequantize_weight_blockwise(eng[k], eng[k + "_scale_inv"]))
        w = _np(after[k])
        amax = np.abs(w).max()
        assert np.abs(deq - w).max() <= amax / 448 * 16  # half an e4m3 ulp (32) of the top binade, in scale units
    r = "model.layers.1.mlp.gate.weight"
    assert eng[r].dtype == jnp.bfloat16 and np.array_equal(_np(eng[r]), _np(after[r].astype(jnp.bfloat16)))


# -- FP8 experts on the Mosaic GPU kernel (issue 29) ------------------------------------------------------------


@pytest.mark.parametrize("impl,experts,tokens", [("mosaic", 3, 12), ("swapab", 3, 12), ("swapab", 8, 2)])
def test_fp8_experts_on_the_mosaic_kernel_match_float64_per_token_reference(impl, experts, tokens):
    """``fp8_expert_impl="mosaic"``: the routed rows in 64-row expert tiles (3 tiles for 24 rows over 3 experts),
    quantized once per tile row in 1x128 e4m3 groups, gate / up / down as grouped Mosaic GPU GEMMs (Mosaic GPU's
    interpreter on the CPU; on CUDA "auto" picks this path for prefill-sized row counts); ``"swapab"``: the grouped
    swap-AB decode GEMM on 16-row tiles (``decode_tile_rows(24, 3)``; at most 4 tiles, the unused ones skipped; on
    CUDA "auto" picks it for decode-sized row counts; at 2 tokens over 8 experts, a decode step's shape: 4 routed
    rows in 8-row tiles, the kernel's 4 tiles fewer than the layout's 7, so the layout is cut as at real decode
    sizes). Each == the float64 per-token
    reference (tests/test_stacked_experts.py) on the same e4m3 weights and the numpy-quantized activations. Ragged:
    moe_intermediate 48 (gate / up N, down K: padded to 128). Measured ~3e-7 relative: float32 accumulation; a
    missing activation quantization, a wrong expert or scale costs percents. Router ids equal the reference's."""
    import fp8_numpy_ref as ref
    from fp8rl_jax.fp8 import formats
    from test_stacked_experts import _reference

    cfg = tiny_qwen3_moe_config(64, hidden_size=128, moe_intermediate_size=48, num_experts=experts,
                                num_experts_per_tok=2)
    rng = np.random.default_rng(29)
    blk = SparseMoeBlock(cfg, linear_precision="fp8", param_dtype=jnp.float32, dtype=jnp.float32, rngs=nnx.Rngs(0))
    router = (rng.normal(size=(experts, 128)) * 0.5).astype(np.float32)
    blk.gate.weight[...] = jnp.asarray(router)
    w64 = {}
    for name in ("gate_proj", "up_proj", "down_proj"):
        lin = getattr(blk.experts, name)
        w = (rng.normal(size=lin.weight.shape) * rng.uniform(0.02, 0.2, size=(experts, 1, 1))).astype(np.float32)
        q, s = ref.quantize_blocks(w, 128, 128, formats.WEIGHT_RECIPE)
        lin.weight[...], lin.weight_scale_inv[...] = jnp.asarray(q), jnp.asarray(s)
        w64[name] = ref.dequantize_blocks(q, s, 128, 128)
    blk.fp8_expert_impl = impl
    x = rng.normal(size=(tokens, 128)).astype(np.float32)
    out, router_ids = blk.forward(jnp.asarray(x))

    def act_q(v):
        q, s = ref.quantize_blocks(np.asarray(v, np.float32), 1, 128, formats.ACTIVATION_RECIPE)
        return ref.dequantize_blocks(q, s, 1, 128)

    want, ids = _reference(x.astype(np.float64), router.astype(np.float64), w64["gate_proj"], w64["up_proj"],
                           w64["down_proj"], 2, act_q)
    np.testing.assert_array_equal(np.asarray(router_ids), ids)
    err = np.linalg.norm(np.asarray(out, np.float64) - want) / np.linalg.norm(want)
    assert err < 1e-5, err
    blk.fp8_expert_impl = "cutlass"
    with pytest.raises(ValueError, match="fp8_expert_impl"):
        blk.forward(jnp.asarray(x))
