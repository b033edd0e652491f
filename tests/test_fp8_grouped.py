"""Grouped (ragged) W8A8 FP8 expert GEMM (issue 21, MoE): interpret-mode numerics against the per-expert unfused
path (bit for bit) and a float64 numpy reference of vLLM's blockwise product; the tile schedule against a plain
Python construction; CUDA lowering (one Triton launch, e4m3 tt.dot, masked stores) without a GPU."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8_numpy_ref as ref
from fp8rl_jax.fp8 import formats, quantize_activation_groupwise
from fp8rl_jax.kernels.pallas_gemm import pallas_w8a8_matmul
from fp8rl_jax.kernels.pallas_grouped import grouped_w8a8_matmul, tile_schedule
from test_fp8_pallas import _lower_for_cuda

E4M3 = jnp.float8_e4m3fn


def _experts(rng, e, n, k):
    w = (rng.normal(size=(e, n, k)) * rng.uniform(0.01, 1.0, size=(e, 1, 1))).astype(np.float32)
    qs = [ref.quantize_blocks(w[i], 128, 128, formats.WEIGHT_RECIPE) for i in range(e)]
    return np.stack([q for q, _ in qs]), np.stack([s for _, s in qs])


@pytest.mark.parametrize("sizes", [[3, 0, 17, 1], [0, 0, 5, 0], [16, 16, 16, 16], [40, 2, 0, 9]])
def test_tile_schedule_covers_every_row_once(sizes):
    bm, max_tiles = 16, -(-sum(sizes) // 16) + len(sizes)
    g, s, e = (np.asarray(a) for a in tile_schedule(jnp.asarray(sizes), bm, max_tiles))
    want = []  # plain Python: each group's rows in bm-row tiles
    start = 0
    for grp, n in enumerate(sizes):
        for r in range(start, start + n, bm):
            want.append((grp, r, start + n))
        start += n
    got = [(int(a), int(b), int(c)) for a, b, c in zip(g, s, e) if b < c]
    assert got == want
    assert all(b == c for b, c in zip(s, e) if (int(b), int(c)) not in {(w[1], w[2]) for w in want})


@pytest.mark.parametrize("sizes,n,k", [([3, 0, 17, 1], 256, 384), ([5, 9], 130, 300), ([33, 1, 0, 30, 2, 6], 128, 256)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_grouped_equals_per_expert_gemm_and_float64(sizes, n, k, dtype):
    rng = np.random.default_rng(sum(sizes) + n)
    e, t = len(sizes), sum(sizes) + 3  # 3 trailing rows in no group: zeros out
    x = np.asarray(jnp.asarray((rng.normal(size=(t, k)) * 2).astype(np.float32), dtype).astype(jnp.float32))
    q, s = _experts(rng, e, n, k)
    y = np.asarray(grouped_w8a8_matmul(jnp.asarray(x, dtype), jnp.asarray(sizes), jnp.asarray(q), jnp.asarray(s),
                                       out_dtype=jnp.float32, interpret=True))
    assert y.shape == (t, n) and np.all(y[sum(sizes):] == 0)
    r0 = 0
    for g, m in enumerate(sizes):
        if m == 0:
            continue
        rows = slice(r0, r0 + m)
        xq, xs = quantize_activation_groupwise(jnp.asarray(x[rows], dtype))
        unfused = np.asarray(pallas_w8a8_matmul(xq, xs, jnp.asarray(q[g]), jnp.asarray(s[g]), interpret=True))
        np.testing.assert_array_equal(y[rows], unfused)
        xq64, xs64 = ref.quantize_blocks(x[rows], 1, 128, formats.ACTIVATION_RECIPE)
        want = ref.dequantize_blocks(xq64, xs64, 1, 128) @ ref.dequantize_blocks(q[g], s[g], 128, 128).T
        assert np.linalg.norm(y[rows] - want) / np.linalg.norm(want) < 1e-6
        r0 += m


def test_bad_arguments_are_named():
    x, q, s = jnp.zeros((4, 256)), jnp.zeros((2, 128, 256), E4M3), jnp.ones((2, 1, 2))
    with pytest.raises(ValueError, match="group_sizes"):
        grouped_w8a8_matmul(x, jnp.asarray([4]), q, s, interpret=True)
    with pytest.raises(ValueError, match="weight_scale_inv"):
        grouped_w8a8_matmul(x, jnp.asarray([2, 2]), q, jnp.ones((2, 2, 2)), interpret=True)
    with pytest.raises(ValueError, match="bm=8"):
        grouped_w8a8_matmul(x, jnp.asarray([2, 2]), q, s, bm=8, interpret=True)


def test_lowers_to_one_triton_launch_with_fp8_dot_and_masked_store():
    hlo, kernels = _lower_for_cuda(
        lambda x, gs, w, s: grouped_w8a8_matmul(x, gs, w, s, interpret=False),
        jax.ShapeDtypeStruct((64, 512), jnp.bfloat16), jax.ShapeDtypeStruct((8,), jnp.int32),
        jax.ShapeDtypeStruct((8, 256, 512), E4M3), jax.ShapeDtypeStruct((8, 2, 4), jnp.float32))
    assert len(kernels) == 1 and hlo.count("__gpu$xla.gpu.triton") == 1
    assert "grid_x = 12 : i32, grid_y = 2 : i32" in hlo  # ceil(64/16) + 8 tiles, 256/128 columns
    ir_text = kernels[0]
    assert "arith.divf" not in ir_text and ir_text.count('"div.rn.f32 $0, $1, $2;"') == 2
    assert re.findall(r"tt\.dot .*: tensor<16x128xf8E4M3FN> \* tensor<128x128xf8E4M3FN> -> tensor<16x128xf32>",
                      ir_text)
    assert re.search(r"tt\.store .*, %\w+ : tensor<16x128x!tt\.ptr<", ir_text)  # a masked store (mask operand)


@pytest.mark.parametrize("inter", [32, 128])  # 128: gate|up fused into one [E, 2I, K] launch
def test_moe_block_with_the_grouped_kernel_matches_the_dequantized_ragged_dot(inter):
    """A Qwen3-MoE layer with FP8 experts: the grouped-kernel path (interpret mode) equals the dequantized
    ragged_dot path (same e4m3 values and scales, float32 accumulation; only the order of additions differs)."""
    from fp8rl_jax.export import export_weights
    from fp8rl_jax.models.decoder import named_params
    from fp8rl_jax.models.loading import build_model
    from fp8rl_jax.models.moe import SparseMoeBlock, tiny_qwen3_moe_config

    cfg = tiny_qwen3_moe_config(256, hidden_size=128, num_hidden_layers=1, num_experts=4, num_experts_per_tok=2,
                                moe_intermediate_size=inter)
    params = export_weights(named_params(build_model(cfg, seed=1)), "fp8_blockwise").tensors
    model = build_model(cfg, dict(params), linear_precision="fp8", param_dtype="float32", dtype="float32")
    block = model.model.layers[0].mlp
    assert isinstance(block, SparseMoeBlock)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 9, 128)).astype(np.float32))
    block.fp8_expert_impl = "ragged_dot"
    want, ids_a = block.forward(x)
    block.fp8_expert_impl = "pallas"
    got, ids_b = block.forward(x)
    np.testing.assert_array_equal(np.asarray(ids_a), np.asarray(ids_b))
    w, g = np.asarray(want, np.float64), np.asarray(got, np.float64)
    assert np.linalg.norm(g - w) / np.linalg.norm(w) < 1e-5
