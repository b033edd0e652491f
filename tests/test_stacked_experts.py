"""Stacked MoE expert weights (issue 19, "scale out"; :mod:`fp8rl_jax.models.experts`).

References are independent of the code under test: the MoE block against a float64 numpy per-expert SwiGLU with
top-k routing (FP8 through ``tests/fp8_numpy_ref.py``); the naming against per-expert HF tensors written to and
read back from safetensors; the variable count against O(layers); the sharding on a fake 8-device mesh (this file
run as a subprocess, as tests/test_mesh.py does) against the mesh's ``expert`` axis, and the sharded model's
logits and TP export against the single-device ones.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(HERE))


def _cfg(**kw):
    from fp8rl_jax.models.moe import tiny_qwen3_moe_config

    sizes = dict(hidden_size=256, moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2,
                 num_hidden_layers=2)
    sizes.update(kw)
    return tiny_qwen3_moe_config(64, **sizes)


def _silu(v):
    return v / (1.0 + np.exp(-v))


def _reference(x, router, wg, wu, wd, k, act_q=None):
    """float64 per-token, per-selected-expert SwiGLU: softmax over experts, top-k, renormalised (Qwen3-MoE).

    ``act_q``: optional activation quantize-dequantize applied to each expert input (the FP8 1x128 groups)."""
    logits = x @ router.T
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ids = np.argsort(-p, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(p, ids, -1)
    w /= w.sum(-1, keepdims=True)
    aq = act_q or (lambda v: v)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for s in range(k):
            j = ids[t, s]
            xi = aq(x[t:t + 1])[0]
            h = _silu(wg[j] @ xi) * (wu[j] @ xi)
            out[t] += w[t, s] * (wd[j] @ aq(h[None])[0])
    return out, ids


@pytest.mark.parametrize("precision,impl", [("dense", None), ("fp8", "ragged_dot"), ("fp8", "pallas")])
def test_block_matches_float64_per_expert_reference(precision, impl):
    import jax.numpy as jnp
    from flax import nnx

    import fp8_numpy_ref as ref
    from fp8rl_jax.fp8 import formats
    from fp8rl_jax.models.moe import SparseMoeBlock

    cfg = _cfg()
    e, inter, hid = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    rng = np.random.default_rng(7)
    blk = SparseMoeBlock(cfg, linear_precision=precision, param_dtype=jnp.float32, dtype=jnp.float32,
                         rngs=nnx.Rngs(0))
    router = (rng.normal(size=(e, hid)) * 0.5).astype(np.float32)  # well separated top-2
    blk.gate.weight[...] = jnp.asarray(router)
    dense = {"gate_proj": (e, inter, hid), "up_proj": (e, inter, hid), "down_proj": (e, hid, inter)}
    w64 = {}
    for name, shape in dense.items():
        w = (rng.normal(size=shape) * rng.uniform(0.02, 0.2, size=(e, 1, 1))).astype(np.float32)
        lin = getattr(blk.experts, name)
        assert tuple(lin.weight[...].shape) == shape  # HF [N, K] per expert, stacked on a leading E axis
        if precision == "fp8":
            q, s = ref.quantize_blocks(w, 128, 128, formats.WEIGHT_RECIPE)
            lin.weight[...] = jnp.asarray(q)
            lin.weight_scale_inv[...] = jnp.asarray(s)
            assert lin.weight_scale_inv[...].shape == (e, -(-shape[1] // 128), -(-shape[2] // 128))
            w64[name] = ref.dequantize_blocks(q, s, 128, 128)
        else:
            lin.weight[...] = jnp.asarray(w)
            w64[name] = w.astype(np.float64)
    if impl:
        blk.fp8_expert_impl = impl
    x = rng.normal(size=(12, hid)).astype(np.float32)
    out, router_ids = nnx.jit(lambda m, v: m.forward(v))(blk, jnp.asarray(x))
    act_q = None
    if precision == "fp8":
        def act_q(v):
            q, s = ref.quantize_blocks(np.asarray(v, np.float32), 1, 128, formats.ACTIVATION_RECIPE)
            return ref.dequantize_blocks(q, s, 1, 128)
    want, ids = _reference(x.astype(np.float64), router.astype(np.float64), w64["gate_proj"], w64["up_proj"],
                           w64["down_proj"], cfg.num_experts_per_tok, act_q)
    np.testing.assert_array_equal(np.asarray(router_ids), ids)
    err = np.linalg.norm(np.asarray(out, np.float64) - want) / np.linalg.norm(want)
    # measured ~3e-7 for all three (the reference quantizes exactly the same activations); skipping the 1x128
    # activation quantization or mis-slicing a stack costs percents
    assert err < (1e-5 if precision == "fp8" else 1e-6), err


def test_named_params_round_trip_per_expert_hf_names(tmp_path):
    """``named_params`` gives per-expert HF names holding the stacks' slices; safetensors save/load and
    ``load_named_params`` restack them; the FP8 export / engine take them too; bad checkpoints are named."""
    import jax
    import jax.numpy as jnp

    from fp8rl_jax.export import ModelParamsReader, export_weights
    from fp8rl_jax.models.decoder import load_named_params, named_params
    from fp8rl_jax.models.hf_io import load_hf_dir, save_hf_dir
    from fp8rl_jax.models.loading import build_model
    from fp8rl_jax.rollout.engine import JaxRolloutEngine

    cfg = _cfg(num_experts=4)
    model = build_model(cfg, seed=1)
    named = named_params(model)
    assert not [k for k in named if ".experts.gate_proj" in k or ".experts.up_proj" in k]
    stack = model.model.layers[1].mlp.experts.down_proj.weight[...]
    for j in range(cfg.num_experts):
        np.testing.assert_array_equal(np.asarray(named[f"model.layers.1.mlp.experts.{j}.down_proj.weight"]),
                                      np.asarray(stack[j]))
        assert named[f"model.layers.0.mlp.experts.{j}.gate_proj.weight"].shape == (128, 256)
    save_hf_dir(str(tmp_path), cfg, named)
    _, loaded, _ = load_hf_dir(str(tmp_path))
    assert set(loaded) == set(named)
    back = build_model(cfg, loaded, seed=9)
    for k, v in named_params(back).items():
        np.testing.assert_array_equal(np.asarray(v), np.asarray(named[k]))
    # errors name the per-expert tensor
    bad = dict(loaded)
    del bad["model.layers.0.mlp.experts.2.up_proj.weight"]
    with pytest.raises(KeyError, match=r"experts\.2\.up_proj"):
        load_named_params(back, bad)
    bad = dict(loaded, **{"model.layers.0.mlp.experts.1.up_proj.weight": np.zeros((128, 255), np.float32)})
    with pytest.raises(ValueError, match=r"experts\.1\.up_proj.*\(128, 256\)"):
        load_named_params(back, bad)
    # FP8: the export of the live stacks (ModelParamsReader) == the export of the per-expert slices, bit for bit
    stacks = ModelParamsReader(model)()
    assert "model.layers.0.mlp.experts.gate_proj.weight" in stacks
    w_hf, w_st = export_weights(named, "fp8_blockwise"), export_weights(stacks, "fp8_blockwise")
    assert list(w_hf.tensors) == list(w_st.tensors)
    for k in w_hf.tensors:
        np.testing.assert_array_equal(np.asarray(w_hf.tensors[k]).view(np.uint8) if w_hf.tensors[k].dtype.itemsize
                                      == 1 else np.asarray(w_hf.tensors[k]),
                                      np.asarray(w_st.tensors[k]).view(np.uint8) if w_st.tensors[k].dtype.itemsize
                                      == 1 else np.asarray(w_st.tensors[k]))
    nan = dict(stacks)
    nan["model.layers.1.mlp.experts.up_proj.weight"] = stacks["model.layers.1.mlp.experts.up_proj.weight"].at[3, 0, 0].set(
        jnp.nan)
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.experts\.3\.up_proj"):
        export_weights(nan, "fp8_blockwise")
    # an FP8 model loads the per-expert e4m3 tensors into its stacks; the engine restacks an update in place
    eng = JaxRolloutEngine(cfg, w_hf, log_kv_cache=False)
    st = eng.model.model.layers[0].mlp.experts.gate_proj
    assert st.weight[...].dtype == jnp.float8_e4m3fn and st.weight_scale_inv[...].shape == (4, 1, 2)
    w2 = export_weights(named_params(build_model(cfg, seed=2)), "fp8_blockwise", version=1)
    eng.update_weights(w2)
    served = eng.named_weights()
    for k, v in w2.tensors.items():
        np.testing.assert_array_equal(np.asarray(served[k]).astype(np.float32), np.asarray(v).astype(np.float32))
    with pytest.raises(ValueError, match="missing"):
        eng.update_weights(type(w2)(tensors={k: v for k, v in w2.tensors.items() if ".experts.3.down" not in k},
                                    format=w2.format, block_size=w2.block_size, version=2))
    jax.clear_caches()


def test_stacked_export_is_the_per_expert_export_and_installs_without_a_copy():
    """``export_weights(expert_stacks=True)`` (the trainer's syncs into the embedded engine): each expert's slice of
    the stacked e4m3 tensor and its scale_inv equal the per-expert export bit for bit; the engine installs the stacks
    as they are (the served arrays are the export's buffers: no restacking copy) and serves what a per-expert
    install serves; a NaN is named by its stack; vLLM refuses the layout by name."""
    import dataclasses

    import jax.numpy as jnp

    from fp8rl_jax.export import ModelParamsReader, export_weights
    from fp8rl_jax.models.decoder import named_params
    from fp8rl_jax.models.loading import build_model
    from fp8rl_jax.rollout.engine import JaxRolloutEngine

    cfg = _cfg(num_experts=4)
    model = build_model(cfg, seed=3)
    stacks = ModelParamsReader(model)()
    per = export_weights(named_params(model), "fp8_blockwise", version=1)
    st = export_weights(stacks, "fp8_blockwise", version=1, expert_stacks=True)
    assert st.metadata.get("expert_stacks") is True and "expert_stacks" not in per.metadata
    stack_names = [k for k in st.tensors if ".mlp.experts." in k]
    assert stack_names and all(".experts.gate_proj." in k or ".experts.up_proj." in k or ".experts.down_proj." in k
                               for k in stack_names)
    as_bytes = lambda a: np.asarray(a).view(np.uint8) if a.dtype.itemsize == 1 else np.asarray(a)  # noqa: E731
    for name in stack_names:
        layer, rest = name.split(".mlp.experts.")
        for j in range(cfg.num_experts):
            np.testing.assert_array_equal(as_bytes(st.tensors[name][j]),
                                          as_bytes(per.tensors[f"{layer}.mlp.experts.{j}.{rest}"]))
    assert {k for k in per.tensors if ".experts." not in k} == {k for k in st.tensors if ".experts." not in k}
    eng_per = JaxRolloutEngine(cfg, per, log_kv_cache=False)
    eng = JaxRolloutEngine(cfg, per, log_kv_cache=False)
    eng.update_weights(st)
    w = eng.model.model.layers[1].mlp.experts.up_proj.weight[...]
    assert w is st.tensors["model.layers.1.mlp.experts.up_proj.weight"]  # installed, not copied
    served, want = eng.named_weights(), eng_per.named_weights()
    assert set(served) == set(want)
    for k in want:
        np.testing.assert_array_equal(as_bytes(served[k]), as_bytes(want[k]))
    nan = dict(stacks, **{"model.layers.0.mlp.experts.down_proj.weight":
                          stacks["model.layers.0.mlp.experts.down_proj.weight"].at[2, 5, 5].set(jnp.inf)})
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.experts\.down_proj\.weight"):
        export_weights(nan, "fp8_blockwise", expert_stacks=True)
    pytest.importorskip("torch", reason="the vLLM engine's refusal needs the [vllm] extra")
    from rollout_bridge.vllm_engine import VllmRolloutEngine

    refuse = VllmRolloutEngine.__new__(VllmRolloutEngine)  # the check runs before anything touches vLLM
    refuse._signature = None
    with pytest.raises(ValueError, match="stacked MoE experts.*expert_stacks=False"):
        refuse._check_signature(dataclasses.replace(st))


def test_dense_init_equals_per_expert_draws():
    """Expert j's gate/up/down are drawn from the j-th triple of successive ``rngs.params()`` keys (what one
    ``Linear`` per expert drew), although the keys are made in one vectorized ``fold_in``; the stream advances."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from fp8rl_jax.models.experts import StackedExperts

    ex = StackedExperts(5, 64, 32, linear_precision="dense", param_dtype=jnp.float32, dtype=jnp.float32,
                        rngs=(rngs := nnx.Rngs(11)))
    ref = nnx.Rngs(11)
    init = nnx.initializers.normal(0.02)
    for j in range(5):
        for name, shape in (("gate_proj", (32, 64)), ("up_proj", (32, 64)), ("down_proj", (64, 32))):
            np.testing.assert_array_equal(np.asarray(getattr(ex, name).weight[...][j]),
                                          np.asarray(init(ref.params(), shape, jnp.float32)))
    np.testing.assert_array_equal(jax.random.key_data(rngs.params()), jax.random.key_data(ref.params()))


@pytest.mark.parametrize("precision,per_proj", [("dense", 1), ("fp8", 2)])
def test_variable_count_is_per_layer_not_per_expert(precision, per_proj):
    """128 experts x 4 layers: 3 (x2 in FP8) expert variables per layer, as with 2 experts."""
    import jax.numpy as jnp
    from flax import nnx

    from fp8rl_jax.models.decoder import CausalLM

    counts = {}
    for e in (2, 128):
        cfg = _cfg(num_experts=e, num_hidden_layers=4, hidden_size=128, moe_intermediate_size=128)
        model = nnx.eval_shape(lambda: CausalLM(cfg, linear_precision=precision, param_dtype=jnp.bfloat16,
                                                dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
        flat = list(nnx.to_flat_state(nnx.state(model, nnx.Param)))
        experts = [p for p, _ in flat if "experts" in p]
        assert len(experts) == 4 * 3 * per_proj
        shapes = {".".join(map(str, p)): v.shape for p, v in flat}
        assert shapes["model.layers.3.mlp.experts.down_proj.weight"] == (e, 128, 128)
        counts[e] = len(flat)
    assert counts[2] == counts[128]


def test_stacks_sharded_over_expert_axis_on_8_devices():
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    r = subprocess.run([sys.executable, HERE, "mesh"], env=env, cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, f"worker failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    res = json.loads(r.stdout.strip().splitlines()[-1])
    for mesh, expert in (("fsdp=4,expert=2", 2), ("fsdp=2,expert=4", 4)):
        got = res[mesh]
        for how in ("loaded", "random"):
            assert got[how]["spec0"] == ["expert"] * got[how]["n_stacks"], got
            assert got[how]["shard_experts"] == [8 // expert], got  # each device holds E / expert experts
        assert got["loaded"]["values_equal"]
        assert got["logits_err"] < 1e-5, got
        assert got["grad_err"] < 1e-4, got
        # the tiled grouped matmul (fp8rl_jax/models/grouped.py) on expert-sharded stacks
        assert got["logits_err_tiled"] < 1e-5, got
        assert got["grad_err_tiled"] < 1e-4, got
        assert got["tp_export_equal"], got


def _mesh_worker() -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from fp8rl_jax.export import ModelParamsReader
    from fp8rl_jax.export_tp import export_tp_shards
    from fp8rl_jax.models.decoder import named_params
    from fp8rl_jax.models.loading import build_model
    from fp8rl_jax.models.moe import SparseMoeBlock
    from fp8rl_jax.parallel.loading import build_sharded_model
    from fp8rl_jax.parallel.mesh import make_mesh

    assert len(jax.devices()) == 8
    cfg = _cfg(num_experts=8)
    ref = build_model(cfg, seed=0)
    host = {k: np.asarray(v) for k, v in named_params(ref).items()}
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 7)))
    SparseMoeBlock.grouped_impl = "ragged_dot"  # the single-device reference
    want = np.asarray(ref(ids))
    loss = lambda m, x: jnp.sum(m(x) ** 2) / 1e3  # noqa: E731
    gref = {".".join(map(str, p)): np.asarray(v[...]) for p, v in
            nnx.to_flat_state(nnx.jit(nnx.grad(loss))(ref, ids))}
    SparseMoeBlock.grouped_impl = "auto"
    out = {}
    for shape in ("fsdp=4,expert=2", "fsdp=2,expert=4"):
        mesh = make_mesh(shape)
        res = {}
        for how, params in (("loaded", host), ("random", None)):
            model, _ = build_sharded_model(cfg, params, mesh, seed=0)
            stacks = [v[...] for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param)) if "experts" in p]
            res[how] = {"n_stacks": len(stacks),
                        "spec0": [a.sharding.spec[0] if len(a.sharding.spec) else None for a in stacks],
                        "shard_experts": sorted({s.data.shape[0] for a in stacks for s in a.addressable_shards})}
            if how == "loaded":
                res[how]["values_equal"] = all(np.array_equal(np.asarray(v), host[k])
                                               for k, v in named_params(model).items())
                got = np.asarray(nnx.jit(lambda m, x: m(x))(model, ids))
                res["logits_err"] = float(np.abs(got - want).max())
                for impl in ("ragged_dot", "tiled"):  # the backward through expert-sharded grouped products
                    SparseMoeBlock.grouped_impl = impl
                    sfx = "" if impl == "ragged_dot" else "_tiled"
                    if impl == "tiled":
                        got = np.asarray(nnx.jit(lambda m, x: m(x))(model, ids))
                        res["logits_err" + sfx] = float(np.abs(got - want).max())
                    g = nnx.jit(nnx.grad(loss))(model, ids)
                    res["grad_err" + sfx] = max(
                        float(np.abs(np.asarray(v[...]) - gref[".".join(map(str, p))]).max() /
                              max(1e-6, np.abs(gref[".".join(map(str, p))]).max())) for p, v in nnx.to_flat_state(g))
                SparseMoeBlock.grouped_impl = "auto"
                tp = "fsdp"  # vLLM TP over the fsdp axis: w13/w2 from the stacks == from per-expert tensors
                a = export_tp_shards(ModelParamsReader(model)(), cfg, mesh, tp_axes=(tp,), fmt="bf16")
                b = export_tp_shards(named_params(model), cfg, mesh, tp_axes=(tp,), fmt="bf16")
                res["tp_export_equal"] = (list(a.tensors) == list(b.tensors) and all(
                    np.array_equal(np.asarray(a.tensors[k]).astype(np.float32),
                                   np.asarray(b.tensors[k]).astype(np.float32)) for k in a.tensors))
        out[shape] = res
    return out


if __name__ == "__main__":
    if sys.argv[1] == "mesh":
        print(json.dumps(_mesh_worker()))
