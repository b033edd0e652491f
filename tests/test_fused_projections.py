"""Fused ``qkv_proj`` / ``gate_up_proj`` in the FP8 rollout engine (issue 21).

What is compared with what:

- the fusion rule against the rule written out from the configs' sizes (every part's rows a multiple of 128, vLLM's
  blockwise-FP8 shard rule), on Qwen3-0.6B, SmolLM2-135M (the GGUF's metadata) and a Qwen3-MoE mix;
- the fused quantizer (jnp and Pallas interpret mode) against the independent float64 numpy + ml_dtypes quantizer
  (tests/fp8_numpy_ref.py) applied to the concatenated weight, bit for bit;
- the fused export against the unfused export's tensors concatenated with numpy, bit for bit, and its compiled XLA
  program against the unfused one (same output bytes, no extra temp buffer, one quantization fusion per group);
- the fused W8A8 linear against the unfused linears (bit for bit on CPU) and the float64 reference of vLLM's W8A8
  product; the fused split-K decode kernel (interpret mode) against the per-part kernels;
- the fused engine against the unfused FP8 engine (``fuse_projections=False``): greedy and sampled tokens,
  logprobs, ``score`` and the MoE routing record, bit for bit; and the real SmolLM2-135M engine (gate|up fused);
- the CUDA lowering of one decode step: one split-K kernel launch per fused linear (counted through the call graph);
- the trainer's sync: the engine installs the fused export's own buffers (no copy), the content probe passes.
"""

from __future__ import annotations

import collections
import re
from dataclasses import replace as dataclasses_replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import fp8_numpy_ref as ref
from fp8rl_jax.export import _export, export_weights
from fp8rl_jax.fp8 import formats, quantize_activation_groupwise, w8a8_block_matmul
from fp8rl_jax.kernels.pallas_decode import fused_w8a8_decode_matmul
from fp8rl_jax.kernels.registry import cuda_device
from fp8rl_jax.kernels.pallas_quant import quantize_weights_fused
from fp8rl_jax.models.config import ModelConfig, hf_param_shapes
from fp8rl_jax.models.decoder import KVCache, named_params, qkv_absmax_from_intermediates, set_qkv_capture
from fp8rl_jax.models.fused import fused_projections, split_tensors, unfused_projections
from fp8rl_jax.models.loading import build_model
from fp8rl_jax.rollout.engine import JaxRolloutEngine, engine_fuses_projections
from fp8rl_jax.rollout.types import SamplingParams
from hlo_calls import is_kernel, triton_launches

E4M3 = jnp.float8_e4m3fn
# 128-aligned tiny Qwen3: q 256, k/v 128, gate/up 512 rows -> every group fuses
QWEN3 = dict(model_type="qwen3", vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64, eos_token_id=2, pad_token_id=0)
PROMPTS = [[5, 17, 99, 3], [7] * 11, [300, 301, 302, 303, 304, 305, 306, 307, 308, 309, 310, 311, 312, 313, 314, 315, 316]]


def _u8(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a


def _params(cfg: ModelConfig, seed: int = 0, scale: float = 3.0) -> dict:
    """Random HF-named float32 params (normal(0.02) init scaled up so logits are far from uniform)."""
    return {k: v * scale if v.ndim == 2 else v for k, v in named_params(build_model(cfg, seed=seed)).items()}


# -- the rule ---------------------------------------------------------------------------------------------------


def test_fusion_rule_is_vllms_block_alignment():
    from fp8rl_jax.models.loading import load_model_config
    from fp8rl_jax.models.presets import qwen3_config

    for cfg in (qwen3_config("0.6b"), load_model_config("smollm2-135m-instruct"),
                ModelConfig(model_type="qwen3_moe", vocab_size=64, hidden_size=128, intermediate_size=384,
                            num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, mlp_only_layers=(1,))):
        qkv_rows = (cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim)
        want = []
        for i in range(cfg.num_hidden_layers):
            if all(r % 128 == 0 for r in qkv_rows):
                want.append(f"model.layers.{i}.self_attn.qkv_proj")
            if not cfg.is_sparse_layer(i) and cfg.intermediate_size % 128 == 0:
                want.append(f"model.layers.{i}.mlp.gate_up_proj")
        got = fused_projections(hf_param_shapes(cfg))
        assert [g.name for g in got] == want, cfg.model_type
        for g in got:
            assert g.parts[0].rsplit(".", 1)[1] in ("q_proj", "gate_proj")  # vLLM row order: [q; k; v], [gate; up]
            assert g.offsets == tuple(np.cumsum((0,) + g.rows[:-1]))
    # SmolLM2-135M: q 576 / k,v 192 rows stay separate (a 128-row block would straddle q and k); gate|up fuse
    smol = hf_param_shapes(load_model_config("smollm2-135m-instruct"))
    assert {g.name.rsplit(".", 1)[1] for g in fused_projections(smol)} == {"gate_up_proj"}
    why = unfused_projections(smol)
    assert why["model.layers.0.self_attn.qkv_proj"] == "part 0 has 576 output rows, not a multiple of 128"
    # a group touching an excluded (unquantized) module stays unfused
    shapes = hf_param_shapes(ModelConfig(**QWEN3))
    got = fused_projections(shapes, exclude=("model.layers.1.self_attn.k_proj",))
    assert "model.layers.1.self_attn.qkv_proj" not in {g.name for g in got} and len(got) == 3
    assert not engine_fuses_projections("bf16") and not engine_fuses_projections("fp8", mesh=object())
    assert engine_fuses_projections("fp8") and not engine_fuses_projections("fp8", fuse_projections=False)


# -- quantization and export -------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["jnp", "pallas"])
@pytest.mark.parametrize("k,dtype", [(384, np.float32), (300, jnp.bfloat16)])
def test_fused_quantizer_matches_numpy_reference_of_the_concatenation(backend, k, dtype):
    rng = np.random.default_rng(k)
    parts = [(rng.normal(size=(n, k)) * rng.uniform(0.01, 3.0, size=(n, 1))).astype(np.float32)
             for n in (256, 128, 128)]
    parts = [np.asarray(jnp.asarray(p, dtype).astype(jnp.float32)) for p in parts]  # the values the kernel sees
    q, s = quantize_weights_fused([jnp.asarray(p, dtype) for p in parts], backend=backend)
    rq, rs = ref.quantize_blocks(np.concatenate(parts), 128, 128, formats.WEIGHT_RECIPE)
    np.testing.assert_array_equal(_u8(q), _u8(rq))
    np.testing.assert_array_equal(np.asarray(s), rs)
    with pytest.raises(ValueError, match="192 rows, not a multiple of 128"):
        quantize_weights_fused([jnp.zeros((256, k)), jnp.zeros((192, k))], backend=backend)
    with pytest.raises(ValueError, match="different K"):
        quantize_weights_fused([jnp.zeros((128, k)), jnp.zeros((128, k + 1))], backend=backend)


@pytest.mark.parametrize("model_type", ["qwen3", "qwen2"])  # qwen2: q/k/v biases, fused too
def test_fused_export_is_the_unfused_export_concatenated(model_type):
    cfg = ModelConfig(**dict(QWEN3, model_type=model_type, attention_bias=model_type == "qwen2",
                             qk_norm=model_type == "qwen3"))
    params = _params(cfg)
    unfused = export_weights(params, "fp8_blockwise").tensors
    w = export_weights(params, "fp8_blockwise", fuse=True)
    groups = fused_projections(hf_param_shapes(cfg))
    assert w.metadata["fused_projections"] == tuple(g.name for g in groups) and len(groups) == 4
    want = {k: (_u8(v), v.dtype) for k, v in unfused.items()}
    for g in groups:
        for suffix in ("weight", "weight_scale_inv", "bias"):
            names = [f"{p}.{suffix}" for p in g.parts]
            if names[0] in want:
                parts = [want.pop(n) for n in names]
                want[f"{g.name}.{suffix}"] = (np.concatenate([b for b, _ in parts]), parts[0][1])
    assert set(w.tensors) == set(want)
    for name, arr in w.tensors.items():
        np.testing.assert_array_equal(_u8(arr), want[name][0], err_msg=name)
        assert arr.dtype == want[name][1], name
    # dense formats stay unfused (the bf16 / float32 engines run q/k/v separately)
    assert set(export_weights(params, "bf16", fuse=True).tensors) == set(export_weights(params, "bf16").tensors)
    # an unquantized module keeps its group unfused, and bf16
    part = export_weights(params, "fp8_blockwise", fuse=True, unquantized=("model.layers.0.mlp.up_proj",)).tensors
    assert "model.layers.0.mlp.gate_up_proj.weight" not in part and part["model.layers.0.mlp.up_proj.weight"].dtype == jnp.bfloat16
    assert "model.layers.1.mlp.gate_up_proj.weight" in part
    # a non-finite part is reported under its fused name
    bad = dict(params)
    bad["model.layers.1.self_attn.v_proj.weight"] = bad["model.layers.1.self_attn.v_proj.weight"].at[3, 5].set(jnp.nan)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.qkv_proj\.weight.*NaN or inf"):
        export_weights(bad, "fp8_blockwise", fuse=True)


def test_fused_export_program_writes_no_more_bytes():
    """Compiled for this CPU: the fused program's outputs are the same bytes, it has no temp buffer the unfused one
    lacks, no entry-level concatenate/copy, and writes each fused weight from one quantization fusion (the
    concatenation fused into it): the sync gains no copy pass."""
    cfg = ModelConfig(**dict(QWEN3, num_hidden_layers=3))
    params = {k: jnp.asarray(v) for k, v in _params(cfg).items()}
    groups = fused_projections(hf_param_shapes(cfg))
    progs = {fz: _export.lower(params, "fp8_blockwise", 128, False, (), True, fused=fz).compile() for fz in ((), groups)}
    unf, fus = (progs[()].memory_analysis(), progs[groups].memory_analysis())
    n_flags_saved = sum(len(g.parts) - 1 for g in groups)
    nbytes = [sum(a.nbytes for a in export_weights(params, "fp8_blockwise", fuse=f).tensors.values())
              for f in (False, True)]
    assert nbytes[0] == nbytes[1]  # the same payload
    # the program's outputs: the payload, one bool flag per tensor and the output tuple's table (fewer entries fused)
    assert 0 < unf.output_size_in_bytes - fus.output_size_in_bytes < 16 * 3 * n_flags_saved
    assert fus.temp_size_in_bytes <= unf.temp_size_in_bytes

    def e4m3_writers(compiled):
        entry = compiled.as_text().split("\nENTRY ")[1]
        lines = [ln for ln in entry.splitlines() if " = " in ln]
        assert not [ln for ln in lines if re.search(r"= f8e4m3fn\[[\d,]+\]\{[\d,]+\} (concatenate|copy)\(", ln)]
        return [ln for ln in lines if re.search(r"= f8e4m3fn\[\d+,\d+\]\{1,0\} fusion\(", ln)]

    n_linears = sum(1 for k in params if k.endswith("proj.weight"))
    assert len(e4m3_writers(progs[()])) == n_linears
    assert len(e4m3_writers(progs[groups])) == n_linears - n_flags_saved


# -- numerics of the fused linear ----------------------------------------------------------------------------------


@pytest.mark.parametrize("m", [1, 5, 40])
def test_fused_linear_equals_unfused_and_float64_reference(m):
    rng = np.random.default_rng(m)
    k, rows = 512, (256, 128, 128)
    ws = [ref.quantize_blocks((rng.normal(size=(n, k)) * 0.05).astype(np.float32), 128, 128, formats.WEIGHT_RECIPE)
          for n in rows]
    qf, sf = np.concatenate([q for q, _ in ws]), np.concatenate([s for _, s in ws])
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16)
    fused = jax.jit(lambda x: w8a8_block_matmul(x, jnp.asarray(qf), jnp.asarray(sf), out_dtype=jnp.float32))(x)
    parts = jax.jit(lambda x: [w8a8_block_matmul(x, jnp.asarray(q), jnp.asarray(s), out_dtype=jnp.float32)
                               for q, s in ws])(x)
    np.testing.assert_array_equal(np.asarray(fused), np.concatenate([np.asarray(p) for p in parts], axis=-1))
    xq, xs = ref.quantize_blocks(np.asarray(x.astype(jnp.float32)), 1, 128, formats.ACTIVATION_RECIPE)
    want = ref.dequantize_blocks(xq, xs, 1, 128) @ ref.dequantize_blocks(qf, sf, 128, 128).T
    err = np.linalg.norm(np.asarray(fused, np.float64) - want) / np.linalg.norm(want)
    assert err < 1e-6, err  # float32 accumulation of exact e4m3 x e4m3 products (a few ulps)


def test_fused_decode_kernel_matches_per_part_kernels_interpret():
    """The CUDA decode kernel (interpret mode) on the fused weight: bit-identical to the per-part launches at
    ``splits=1``; with its own split-K factor (chosen for the fused N, so different from the parts') only the order
    of the float32 additions of K-block partials changes: within 1e-6 of the float64 reference, like the parts."""
    rng = np.random.default_rng(7)
    k, rows, m = 1024, (256, 128, 128), 2
    ws = [ref.quantize_blocks((rng.normal(size=(n, k)) * 0.05).astype(np.float32), 128, 128, formats.WEIGHT_RECIPE)
          for n in rows]
    qf, sf = np.concatenate([q for q, _ in ws]), np.concatenate([s for _, s in ws])
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.float32)
    run = lambda q, s, splits: np.asarray(fused_w8a8_decode_matmul(  # noqa: E731
        x, jnp.asarray(q), jnp.asarray(s), splits=splits, out_dtype=jnp.float32, interpret=True))
    np.testing.assert_array_equal(run(qf, sf, 1), np.concatenate([run(q, s, 1) for q, s in ws], axis=-1))
    xq, xs = quantize_activation_groupwise(x)
    want = ref.dequantize_blocks(np.asarray(xq), np.asarray(xs), 1, 128) @ ref.dequantize_blocks(qf, sf, 128, 128).T
    for y in (run(qf, sf, None), np.concatenate([run(q, s, None) for q, s in ws], axis=-1)):
        assert np.linalg.norm(y - want) / np.linalg.norm(want) < 1e-6


# -- the engine ----------------------------------------------------------------------------------------------------


def _engines(cfg, params, kv_scales=None, **kw):
    """``(unfused, fused)`` FP8 engines of the same weights (the fused one given the fused export)."""
    unfused = JaxRolloutEngine(cfg, export_weights(params, "fp8_blockwise", kv_scales=kv_scales),
                               fuse_projections=False, log_kv_cache=False, **kw)
    fused = JaxRolloutEngine(cfg, export_weights(params, "fp8_blockwise", kv_scales=kv_scales, fuse=True),
                             log_kv_cache=False, **kw)
    return unfused, fused


def _same_rollouts(a, b, sp):
    ra, rb = a.generate(PROMPTS, sp), b.generate(PROMPTS, sp)
    np.testing.assert_array_equal(ra.response_token_ids, rb.response_token_ids)
    np.testing.assert_array_equal(ra.rollout_logprobs, rb.rollout_logprobs)
    return ra


@pytest.mark.parametrize("variant", ["qwen3", "qwen2_bias", "fp8_kv_attention"])
def test_fused_engine_equals_unfused_engine(variant):
    cfg = ModelConfig(**dict(QWEN3, model_type="qwen2" if variant == "qwen2_bias" else "qwen3",
                             attention_bias=variant == "qwen2_bias", qk_norm=variant != "qwen2_bias"))
    params = _params(cfg)
    if variant == "fp8_kv_attention":
        from fp8rl_jax.fp8.kv_cache import KVScales

        kv = KVScales(*(np.full(cfg.num_hidden_layers, v, np.float32) for v in (0.02, 0.01, 0.05)))
        unfused, fused = _engines(cfg, params, kv, kv_cache_dtype="fp8_e4m3", fp8_attention=True)
    else:
        unfused, fused = _engines(cfg, params)
    assert not unfused.fused_projections and len(fused.fused_projections) == 4
    attn = fused.model.model.layers[0].self_attn
    assert attn.q_proj is None and attn.qkv_proj.weight[...].shape == (512, 256)
    greedy = _same_rollouts(unfused, fused, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert len({tuple(r) for r in greedy.response_token_ids}) > 1  # not a degenerate model
    _same_rollouts(unfused, fused, SamplingParams(temperature=1.0, top_k=50, top_p=0.9, max_tokens=8, n=2, seed=5,
                                                  ignore_eos=True))
    conts = [[11, 12, 13], [14], [15, 16]]
    for x, y in zip(unfused.score(PROMPTS, conts), fused.score(PROMPTS, conts)):
        np.testing.assert_array_equal(x, y)
    if variant != "qwen3":
        return
    # in-place updates under either naming; the served weights read back under the HF names
    new = _params(cfg, seed=1)
    hf = export_weights(new, "fp8_blockwise", version=1)
    unfused.update_weights(hf)
    fused.update_weights(hf)
    # max_tokens as in the first greedy run: the engines reuse their compiled programs (new weights, same shapes)
    _same_rollouts(unfused, fused, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    got = fused.named_weights()
    assert set(got) == set(hf.tensors)
    for name, arr in hf.tensors.items():
        np.testing.assert_array_equal(_u8(got[name]), _u8(arr), err_msg=name)
    w = export_weights(_params(cfg, seed=2), "fp8_blockwise", version=2, fuse=True)
    fused.update_weights(w)
    for name, var in fused._names.items():  # installed as they are: the export's own buffers
        assert var[...].unsafe_buffer_pointer() == w.tensors[name].unsafe_buffer_pointer(), name
    with pytest.raises(ValueError, match=r"missing \['model.layers.0.mlp.up_proj.weight'\]"):
        bad = dict(hf.tensors)
        bad.pop("model.layers.0.mlp.up_proj.weight")
        fused.update_weights(type(hf)(tensors=bad, format=hf.format, version=3))
    with pytest.raises(ValueError, match="qkv_proj.weight expects 128 rows"):
        bad = dict(hf.tensors)
        bad["model.layers.1.self_attn.k_proj.weight"] = jnp.zeros((256, 256), E4M3)
        fused.update_weights(type(hf)(tensors=bad, format=hf.format, version=3))
    assert fused.weights_version == 2  # the refused updates left the engine as it was


def test_moe_engine_fuses_attention_and_dense_mlp_only():
    cfg = ModelConfig(model_type="qwen3_moe", vocab_size=512, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=128, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=128, norm_topk_prob=True, mlp_only_layers=(1,),
                      eos_token_id=2, pad_token_id=0)
    unfused, fused = _engines(cfg, _params(cfg))
    assert [g.name for g in fused.fused_projections] == [
        "model.layers.0.self_attn.qkv_proj", "model.layers.1.self_attn.qkv_proj", "model.layers.1.mlp.gate_up_proj"]
    assert fused.model.model.layers[0].mlp.experts.gate_proj is not None  # experts are out of scope
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    a, b = unfused.generate(PROMPTS, sp), fused.generate(PROMPTS, sp)
    np.testing.assert_array_equal(a.response_token_ids, b.response_token_ids)
    np.testing.assert_array_equal(a.rollout_logprobs, b.rollout_logprobs)
    np.testing.assert_array_equal(a.routed_experts, b.routed_experts)


def test_qkv_capture_sees_the_same_q_k_v_through_the_fused_projection():
    """KV-scale calibration reads q/k/v after QK-norm and RoPE; a fused model sows the same maxima."""
    cfg = ModelConfig(**QWEN3)
    tensors = dict(export_weights(_params(cfg), "fp8_blockwise").tensors)
    ids = jnp.asarray(np.random.default_rng(0).integers(3, 512, (2, 9)), jnp.int32)
    got = []
    for fuse in (False, True):
        model = build_model(cfg, tensors, linear_precision="fp8", param_dtype="bfloat16", dtype="bfloat16",
                            fuse_projections=fuse)
        set_qkv_capture(model)
        _, inter = nnx.capture(lambda m, x: m(x), nnx.Intermediate)(model, ids)
        got.append(np.asarray(qkv_absmax_from_intermediates(inter, cfg.num_hidden_layers)))
    np.testing.assert_array_equal(*got)
    assert got[0].shape == (2, 3, 2, 9)


@pytest.mark.slow
def test_real_smollm2_engine_with_fused_gate_up_equals_unfused():
    """SmolLM2-135M-Instruct (packaged GGUF): q/k/v stay separate (576/192 rows), the 30 gate|up pairs fuse.

    The engines run the real weights and shapes of the first ``LAYERS`` of the 30 layers (the embedding, the final
    norm and the tied head are the real ones too): every layer has the same shapes, so each one takes the same
    fusion decision and the same kernels, and bit-identity of fused vs unfused holds layer by layer; the 30-layer
    engines only compiled the same layer 15x more (~60 s vs ~15 s). The decision for all 30 layers is checked on
    the full config with the rule the engine applies (``CausalLM`` fuses ``fused_projections(hf_param_shapes)``)."""
    from fp8rl_jax.models.loading import load_checkpoint

    cfg, params = load_checkpoint("smollm2-135m-instruct")
    full = fused_projections(hf_param_shapes(cfg))
    assert len(full) == cfg.num_hidden_layers == 30
    assert {g.name.rsplit(".", 1)[1] for g in full} == {"gate_up_proj"}
    LAYERS = 4
    cfg = dataclasses_replace(cfg, num_hidden_layers=LAYERS)
    params = {k: v for k, v in params.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < LAYERS}
    assert set(params) == set(hf_param_shapes(cfg))
    unfused, fused = _engines(cfg, params)
    assert [g.name for g in fused.fused_projections] == [g.name for g in full[:LAYERS]]
    assert {g.name.rsplit(".", 1)[1] for g in fused.fused_projections} == {"gate_up_proj"}
    _same_rollouts(unfused, fused, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))


# -- CUDA lowering -------------------------------------------------------------------------------------------------


def _launches(hlo: str) -> collections.Counter:
    """Kernel launches (Triton or Mosaic GPU) per e4m3 weight shape (``"NxK"``: the first e4m3 operand, the swap-AB
    decode kernel's A operand), counted through the call graph from ``@main`` (tests/hlo_calls.py)."""

    def weight_shape(line):
        operands = line.rsplit(" : (", 1)[-1].split(") ->", 1)[0]  # the operand types, not the results
        m = re.search(r"tensor<(\d+x\d+)xf8E4M3FN>", operands)
        return m.group(1) if m else "other"

    return triton_launches(hlo, weight_shape, match=is_kernel)


def test_decode_step_lowers_to_one_split_k_launch_per_fused_linear_for_cuda():
    """One decode step of the FP8 model lowered for CUDA on this CPU: every FP8 linear is one launch of the swap-AB
    split-K decode kernel (issue 37; the activation quantized once before it, straight into the kernel's layout, by
    the ``quant`` family's decode operand quantizer);
    fused, a layer launches qkv, o, gate_up and down (4) instead of q, k, v, o, gate, up, down (7). No other kernel
    is left in the step."""
    from test_fp8_pallas import _lower_for_cuda

    cfg = ModelConfig(**QWEN3)
    tensors = dict(export_weights(_params(cfg), "fp8_blockwise").tensors)
    counts, names = {}, {}
    for fuse in (False, True):
        model = build_model(cfg, tensors, linear_precision="fp8", param_dtype="bfloat16", dtype="bfloat16",
                            fuse_projections=fuse)
        graphdef, state = nnx.split(model)

        def step(state, tok, pos, kv_mask, cache, graphdef=graphdef):
            m = nnx.merge(graphdef, state)
            h, cache = m.hidden_states(tok, pos, kv_mask, cache, 5)
            return m.logits(h[:, 0]), cache

        hlo, kernels = _lower_for_cuda(step, state, jnp.zeros((2, 1), jnp.int32), jnp.zeros((2, 1), jnp.int32),
                                       jnp.ones((2, 24), bool), KVCache.zeros(cfg, 2, 24, jnp.bfloat16))
        counts[fuse] = _launches(hlo)
        names[fuse] = set(re.findall(r"fp8_decode_gemm_swapab_wgmma", hlo)) | {
            re.search(r"tt\.func public @(\w+)", k).group(1) for k in kernels}
    n_layers = cfg.num_hidden_layers
    assert names[False] == names[True] == {"fp8_decode_gemm_swapab_wgmma", "fp8_decode_operand_quant"}
    h, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim

    def per_layer(shapes):  # [(N, K)] of one layer's FP8 linears -> launches of the whole step, with one
        # activation quantization launch per linear (no e4m3 operand: "other")
        return collections.Counter({f"{n}x{k}": 0 for n, k in shapes}) + collections.Counter(
            [f"{n}x{k}" for n, k in shapes for _ in range(n_layers)]) + collections.Counter(
            {"other": len(shapes) * n_layers})

    assert counts[False] == per_layer([(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i)])
    assert counts[True] == per_layer([(q + 2 * kv, h), (h, q), (2 * i, h), (h, i)])


# -- the trainer's sync --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_trainer_sync_installs_the_fused_export_without_a_copy(tmp_path):
    from conftest import make_tiny_run_dir

    from fp8rl_jax.trainer.config import TrainConfig
    from fp8rl_jax.trainer.loop import RLTrainer

    d = make_tiny_run_dir(tmp_path / "m", arch="qwen3", hidden_size=128, intermediate_size=128,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=128)
    tr = RLTrainer(TrainConfig(output_dir=str(tmp_path / "run"), model=d, num_steps=1, prompts_per_step=2,
                               samples_per_prompt=2, max_tokens=4, progress_bar=False, checkpoint_every=0,
                               plots=False, rollout_precision="fp8", verify_sync="every_step", mismatch_action="raise"))
    assert len(tr.engine.fused_projections) == 4  # qkv and gate_up in both layers
    seen = []
    update = tr.engine.update_weights
    tr.engine.update_weights = lambda w: (seen.append(w), update(w))[1]
    tr.step()  # verify_sync="every_step": the engine's probe logprobs match the trainer's forward
    (w,) = seen
    assert w.metadata["fused_projections"] == tuple(g.name for g in tr.engine.fused_projections)
    for name, var in tr.engine._names.items():
        assert var[...].unsafe_buffer_pointer() == w.tensors[name].unsafe_buffer_pointer(), name
    hf = tr.export()  # the default export keeps the HF names (vLLM, torch receivers, HF export)
    assert "model.layers.0.self_attn.q_proj.weight" in hf.tensors and "fused_projections" not in hf.metadata
    got = tr.engine.named_weights()
    assert set(got) == set(hf.tensors)
    for name, arr in hf.tensors.items():
        np.testing.assert_array_equal(_u8(got[name]), _u8(arr), err_msg=name)


# -- on a CUDA GPU (skipped without one; benchmarks/run_gpu.sh runs it) -----------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(cuda_device() is None, reason="needs a CUDA GPU (none on this machine)")
def test_on_gpu_fused_export_and_engine():
    """On the GPU, at Qwen3-0.6B widths (2 layers, random weights):

    - the fused export (per-part Pallas kernels writing one aliased buffer) is the unfused export concatenated, bit
      for bit (each part's kernel writes its own rows; nothing else touches the buffer);
    - the fused engine scores like the unfused one. Not bit for bit here: each fused linear runs one split-K decode
      launch whose split factor is chosen for the fused N (``choose_splits``), so the float32 additions of K-block
      partials are grouped differently from the parts' launches (a few float32 ulps, < 1e-6 relative, see
      test_fp8_decode.py). That is far below bf16's rounding step (2**-9), so the bf16 activations differ only where
      a value sits on a rounding boundary; the teacher-forced logprobs must then agree to well under the 0.01-nat
      level of one bf16 rounding of the activations through a model (verify.PROBE_TOLERANCE's bf16 measurement).
    """
    from fp8rl_jax.models.presets import qwen3_config

    gpu = jax.devices("gpu")[0]
    cfg = dataclasses_replace(qwen3_config("0.6b"), num_hidden_layers=2)
    with jax.default_device(gpu):
        params = named_params(build_model(cfg, seed=0, param_dtype=jnp.bfloat16))
        unfused = export_weights(params, "fp8_blockwise")
        fused = export_weights(params, "fp8_blockwise", fuse=True)
        groups = fused_projections(hf_param_shapes(cfg))
        assert len(groups) == 4
        for name, arr in split_tensors(fused.tensors, groups).items():
            np.testing.assert_array_equal(_u8(arr), _u8(unfused.tensors[name]), err_msg=name)
        engines = [JaxRolloutEngine(cfg, w, fuse_projections=f, log_kv_cache=False)
                   for w, f in ((unfused, False), (fused, True))]
        rng = np.random.default_rng(0)
        prompts = [list(map(int, rng.integers(0, 150000, 24))), list(map(int, rng.integers(0, 150000, 9)))]
        conts = [list(map(int, rng.integers(0, 150000, 8))), list(map(int, rng.integers(0, 150000, 5)))]
        a, b = (np.concatenate(e.score(prompts, conts)) for e in engines)
        assert np.isfinite(b).all() and np.mean(np.abs(a - b)) < 1e-2, (a, b)
        rb = engines[1].generate(prompts, SamplingParams(n=2, max_tokens=8, seed=0))
        assert rb.response_token_ids.shape == (4, 8) and np.isfinite(rb.rollout_logprobs).all()
