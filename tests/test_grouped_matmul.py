"""The tiled dropless grouped matmul (issue 19; :mod:`fp8rl_jax.models.grouped`) and the MoE block on it.

References: float64 numpy per-row products ``x[r] @ w[g(r)].T`` and their closed-form gradients
(``dx[r] = dy[r] @ w[g(r)]``, ``dw[e] = sum_{g(r)=e} dy[r]^T x[r]``); for the MoE block a float64 per-token loop
over the selected experts, FP8 through ``tests/fp8_numpy_ref.py``'s blockwise quantizer (the FP8 training
forward's W8A8 numerics); the training gradient against the MoE block's ``ragged_dot`` path. Memory: the
compiled temporaries of a tiled against a ``ragged_dot`` expert backward (XLA's ``memory_analysis``, not timed).
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _splits():
    """Group sizes that stress the layout: empty groups, one full group, sizes m-1 / m / m+1, random."""
    rng = np.random.default_rng(0)
    return [
        ([0, 37, 0, 0], 8),
        ([7, 8, 9, 0, 16], 8),
        ([1, 1, 1, 1, 1, 1], 4),
        (list(rng.multinomial(203, [0.5, 0.2, 0.1, 0.1, 0.05, 0.05])), 16),
        ([3, 0, 2], 64),
    ]


@pytest.mark.parametrize("sizes,m", _splits())
def test_tile_layout_places_every_row_once_in_its_groups_tiles(sizes, m):
    import jax.numpy as jnp

    from fp8rl_jax.models.grouped import num_tiles, tile_layout

    r, e = int(sum(sizes)), len(sizes)
    lay = tile_layout(jnp.asarray(sizes, jnp.int32), r, m)
    slot_row, valid, tile_group, row_slot = (np.asarray(a) for a in lay)
    g = num_tiles(r, e, m)
    assert slot_row.shape == (g * m,) and tile_group.shape == (g,) and row_slot.shape == (r,)
    # row_slot inverts slot_row on the valid slots: every row's slot is valid and holds that row
    assert valid[row_slot].all()
    np.testing.assert_array_equal(slot_row[row_slot], np.arange(r))
    # the bound holds: every group's ceil(size / m) tiles fit
    assert sum(-(-s // m) for s in sizes) <= g
    rows = slot_row[valid]
    np.testing.assert_array_equal(np.sort(rows), np.arange(r))  # each row exactly once
    group_of_row = np.repeat(np.arange(e), sizes)
    np.testing.assert_array_equal(group_of_row[rows], tile_group[np.nonzero(valid)[0] // m])
    # rows keep their order (a group's rows fill its tiles front to back)
    assert np.all(np.diff(rows) > 0)


@pytest.mark.parametrize("sizes,m", _splits())
def test_grouped_matmul_and_its_gradients_match_float64(sizes, m):
    import jax
    import jax.numpy as jnp

    from fp8rl_jax.models.grouped import grouped_matmul

    rng = np.random.default_rng(len(sizes) + m)
    r, e, n, k = int(sum(sizes)), len(sizes), 24, 40
    x = rng.normal(size=(r, k)).astype(np.float32)
    w = rng.normal(size=(e, n, k)).astype(np.float32)
    dy = rng.normal(size=(r, n)).astype(np.float32)
    grp = np.repeat(np.arange(e), sizes)
    x64, w64, dy64 = x.astype(np.float64), w.astype(np.float64), dy.astype(np.float64)
    want = np.einsum("rk,rnk->rn", x64, w64[grp])
    gs = jnp.asarray(sizes, jnp.int32)
    out, vjp = jax.vjp(lambda a, b: grouped_matmul(a, b, gs, tile_rows=m), jnp.asarray(x), jnp.asarray(w))
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=1e-5, atol=1e-5)
    dx, dw = vjp(jnp.asarray(dy))
    np.testing.assert_allclose(np.asarray(dx, np.float64), np.einsum("rn,rnk->rk", dy64, w64[grp]),
                               rtol=1e-5, atol=1e-5)
    dw_want = np.zeros_like(w64)
    np.add.at(dw_want, grp, np.einsum("rn,rk->rnk", dy64, x64))
    np.testing.assert_allclose(np.asarray(dw, np.float64), dw_want, rtol=1e-5, atol=1e-5)


def test_bad_shapes_are_named():
    import jax.numpy as jnp

    from fp8rl_jax.models.grouped import grouped_matmul, tile_layout, tiled_dot

    with pytest.raises(ValueError, match="group_sizes"):
        grouped_matmul(jnp.zeros((4, 8)), jnp.zeros((2, 3, 8)), jnp.zeros((3,), jnp.int32))
    with pytest.raises(ValueError, match=r"x \[G, m, K\]"):
        tiled_dot(jnp.zeros((2, 4, 8)), jnp.zeros((2, 3, 7)))
    with pytest.raises(ValueError, match="1-D"):
        tile_layout(jnp.zeros((2, 2), jnp.int32), 4, 8)
    with pytest.raises(ValueError, match="tile_rows > 0"):
        tile_layout(jnp.zeros((2,), jnp.int32), 4, 0)


def _block(precision, *, seed=0, e=8, hidden=256, inter=128, k=2):
    import jax.numpy as jnp
    from flax import nnx

    from fp8rl_jax.models.moe import SparseMoeBlock, tiny_qwen3_moe_config

    cfg = tiny_qwen3_moe_config(64, hidden_size=hidden, moe_intermediate_size=inter, num_experts=e,
                                num_experts_per_tok=k)
    blk = SparseMoeBlock(cfg, linear_precision=precision, param_dtype=jnp.float32, dtype=jnp.float32,
                         rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed + 11)
    blk.gate.weight[...] = jnp.asarray((rng.normal(size=(e, hidden)) * 0.5).astype(np.float32))
    for name in ("gate_proj", "up_proj", "down_proj"):
        lin = getattr(blk.experts, name)
        if precision == "dense":
            lin.weight[...] = jnp.asarray((rng.normal(size=lin.weight.shape)
                                           * rng.uniform(0.02, 0.2, size=(e, 1, 1))).astype(np.float32))
    return cfg, blk


def _f64_moe(x, blk, k, weight_q=None, act_q=None, ws=None):
    """float64 Qwen3-MoE block (tests/test_stacked_experts.py's per-token reference) on the block's router and
    stacks (or ``ws``), each weight through ``weight_q``, expert inputs through ``act_q``."""
    from test_stacked_experts import _reference

    if ws is None:
        ws = {n: np.asarray(getattr(blk.experts, n).weight[...], np.float64)
              for n in ("gate_proj", "up_proj", "down_proj")}
    if weight_q:
        ws = {n: weight_q(v) for n, v in ws.items()}
    out, _ = _reference(x, np.asarray(blk.gate.weight[...], np.float64), ws["gate_proj"], ws["up_proj"],
                        ws["down_proj"], k, act_q)
    return out


def test_moe_block_tiled_matches_float64_and_ragged_dot():
    """Dense experts: the tiled path == the float64 loop, == the ragged_dot path; gradients equal ragged_dot's
    (the router's and every expert stack's) for several tile edges."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    cfg, blk = _block("dense")
    x = np.random.default_rng(3).normal(size=(45, cfg.hidden_size)).astype(np.float32)
    want = _f64_moe(x.astype(np.float64), blk, cfg.num_experts_per_tok)

    def loss(m, v):
        return jnp.sum(m(v) ** 2)

    results = {}
    for impl, m in (("ragged_dot", None), ("tiled", None), ("tiled", 8), ("tiled", 32)):
        blk.grouped_impl, blk.tile_rows = impl, m
        out = np.asarray(nnx.jit(lambda mod, v: mod(v))(blk, jnp.asarray(x)), np.float64)
        err = np.abs(out - want).max() / np.abs(want).max()
        assert err < 1e-5, (impl, m, err)
        g = nnx.jit(nnx.grad(loss))(blk, jnp.asarray(x))
        results[(impl, m)] = jax.tree.map(np.asarray, nnx.state(g, nnx.Param))
    ref = results[("ragged_dot", None)]
    for key, g in results.items():
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref)):
            np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6 * max(1.0, float(np.abs(b).max())),
                                       err_msg=str(key))
    blk.grouped_impl = "bogus"
    with pytest.raises(ValueError, match="grouped_impl"):
        blk(jnp.asarray(x))


def test_moe_block_fp8_weights_tiled_matches_float64():
    """FP8 (e4m3 + scale_inv) experts off the kernel, tiled: == the float64 W8A8 blockwise reference."""
    import jax.numpy as jnp

    import fp8_numpy_ref as ref
    from fp8rl_jax.fp8 import formats

    cfg, blk = _block("fp8")
    rng = np.random.default_rng(5)
    for name in ("gate_proj", "up_proj", "down_proj"):
        lin = getattr(blk.experts, name)
        w = (rng.normal(size=lin.weight.shape) * 0.1).astype(np.float32)
        q, s = ref.quantize_blocks(w, 128, 128, formats.WEIGHT_RECIPE)
        lin.weight[...], lin.weight_scale_inv[...] = jnp.asarray(q), jnp.asarray(s)

    def act_q(v):
        q, s = ref.quantize_blocks(np.asarray(v, np.float32), 1, 128, formats.ACTIVATION_RECIPE)
        return ref.dequantize_blocks(q, s, 1, 128)

    blk.fp8_expert_impl, blk.grouped_impl, blk.tile_rows = "ragged_dot", "tiled", 16
    x = rng.normal(size=(30, cfg.hidden_size)).astype(np.float32)
    out = np.asarray(blk(jnp.asarray(x)), np.float64)
    deq = {n: ref.dequantize_blocks(np.asarray(getattr(blk.experts, n).weight[...]),
                                    np.asarray(getattr(blk.experts, n).weight_scale_inv[...]), 128, 128)
           for n in ("gate_proj", "up_proj", "down_proj")}
    want = _f64_moe(x.astype(np.float64), blk, cfg.num_experts_per_tok, ws=deq, act_q=act_q)
    err = np.linalg.norm(out - want) / np.linalg.norm(want)
    assert err < 1e-5, err


def test_fp8_training_product_runs_tiled_with_w8a8_numerics_and_ragged_dot_gradients():
    """FP8 training's ``dot_general`` on the experts: forward == the float64 W8A8 blockwise reference (weights
    128x128 e4m3 blocks, activations 1x128 groups) on the routed rows only; the float32-backward gradients equal
    the dense ragged_dot path's (the straight-through estimator)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import fp8_numpy_ref as ref
    from fp8rl_jax.fp8 import formats
    from fp8rl_jax.fp8.training import make_fp8_train_dot_general

    cfg, blk = _block("dense", seed=2)
    # positive inputs and an all-negative router row: the last expert is never routed to
    x = np.abs(np.random.default_rng(9).normal(size=(33, cfg.hidden_size))).astype(np.float32)
    blk.gate.weight[...] = blk.gate.weight[...].at[-1].set(-1.0)

    def weight_q(v):
        q, s = ref.quantize_blocks(np.asarray(v, np.float32), 128, 128, formats.WEIGHT_RECIPE)
        return ref.dequantize_blocks(q, s, 128, 128)

    def act_q(v):
        q, s = ref.quantize_blocks(np.asarray(v, np.float32), 1, 128, formats.ACTIVATION_RECIPE)
        return ref.dequantize_blocks(q, s, 1, 128)

    want = _f64_moe(x.astype(np.float64), blk, cfg.num_experts_per_tok, weight_q=weight_q, act_q=act_q)

    def loss(m, v):
        return jnp.sum(m(v) ** 2)

    blk.grouped_impl = "ragged_dot"
    g_ref = jax.tree.map(np.asarray, nnx.state(nnx.grad(loss)(blk, jnp.asarray(x)), nnx.Param))
    dg = make_fp8_train_dot_general("float32")
    for lin in (blk.experts.gate_proj, blk.experts.up_proj, blk.experts.down_proj):
        lin.dot_general = dg
    blk.tile_rows = 8
    out = np.asarray(nnx.jit(lambda m, v: m(v))(blk, jnp.asarray(x)), np.float64)
    err = np.linalg.norm(out - want) / np.linalg.norm(want)
    assert err < 1e-5, err  # a dense (unquantized) forward is ~1e-2 off
    for grad in ("float32", "bf16", "e5m2"):  # the FP8 training backward precisions
        dg = make_fp8_train_dot_general(grad)
        for lin in (blk.experts.gate_proj, blk.experts.up_proj, blk.experts.down_proj):
            lin.dot_general = dg
        g = jax.tree.map(np.asarray, nnx.state(nnx.jit(nnx.grad(loss))(blk, jnp.asarray(x)), nnx.Param))
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
            # the straight-through gradient is evaluated at the quantized forward: close to the dense one, not equal
            assert np.all(np.isfinite(a)), grad
            cos = float(np.sum(a * b) / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30))
            assert cos > 0.99, (grad, cos)
        # an expert no token was routed to gets exactly zero gradient (padding slots add nothing to any expert)
        used = set(np.asarray(blk.router(jnp.asarray(x))[2]).ravel().tolist())
        ge = g["experts"]
        for name in ("gate_proj", "up_proj", "down_proj"):
            w = np.asarray(ge[name]["weight"])
            for j in range(cfg.num_experts):
                assert (np.abs(w[j]).max() > 0) == (j in used), (grad, name, j)
        assert cfg.num_experts - 1 not in used and len(used) > 1  # both cases are exercised


def test_tiled_expert_backward_needs_far_less_memory_than_ragged_dot():
    """XLA's compiled temporaries of one MoE block's backward (abstract inputs, nothing run): the tiled path's
    do not grow with the number of experts the way ragged_dot's dense expansion does (issue 19: the 30B-A3B train
    step's 322-572 GiB). E = 64 experts, 2048 tokens, top-8."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    cfg, blk = _block("dense", e=64, hidden=256, inter=128, k=8)
    graph, state = nnx.split(blk)

    def temp(impl):
        def loss(st, v):
            m = nnx.merge(graph, st)
            m.grouped_impl = impl
            return jnp.sum(m(v).astype(jnp.float32) ** 2)

        x = jax.ShapeDtypeStruct((2048, cfg.hidden_size), jnp.float32)
        st = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)
        return jax.jit(jax.grad(loss)).lower(st, x).compile().memory_analysis().temp_size_in_bytes

    tiled, ragged = temp("tiled"), temp("ragged_dot")
    rows_bytes = 2048 * 8 * (cfg.hidden_size + cfg.moe_intermediate_size) * 4
    assert tiled < ragged / 4, (tiled, ragged)
    assert tiled < 16 * rows_bytes, (tiled, rows_bytes)  # linear in the routed rows, not E times them


def test_auto_picks_ragged_dot_for_decode_and_tiles_for_training():
    """At Qwen3-30B-A3B expert sizes (E=128, top-8, N=768, K=2048): a small decode step's few routed rows would make
    most tiles padding copies of a weight, so auto keeps ragged_dot; large decode batches, prefill and training get
    tiles."""
    from fp8rl_jax.models.grouped import choose_tile_rows, num_tiles, prefer_tiled

    def pick(rows):
        m = choose_tile_rows(rows, 128, 768, 2048)
        return prefer_tiled(rows, 128, m, 768, 2048), num_tiles(rows, 128, m)

    assert pick(8) == (False, pick(8)[1]) and pick(8)[1] > 100       # batch-1 decode: 113 tiles for 8 rows
    assert not pick(64 * 8)[0]                                         # batch-64 decode
    assert pick(128 * 8)[0]                                            # batch-128 decode: 142 tiles for 1024 rows
    assert pick(4096 * 8)[0] and pick(36864 * 8)[0]                   # prefill, a training micro-batch


def test_fp8_training_experts_on_the_cpu_are_unchanged_by_the_cuda_tile_edge():
    """Issue 29: where the program is lowered for CUDA the FP8 training experts use tiles of a multiple of 64 rows
    (whole wgmma warpgroups for the Mosaic GEMMs); lowered for the CPU the program computes exactly what the
    kernel-free path computes: forward and every gradient bit for bit equal to ``FP8RL_KERNELS=xla`` (which never
    stages the CUDA branch), here with 8-row tiles and the e4m3 backward."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from fp8rl_jax.kernels import registry
    from fp8rl_jax.fp8.training import make_fp8_train_dot_general

    cfg, blk = _block("dense", seed=4)
    dg = make_fp8_train_dot_general("e4m3")
    for lin in (blk.experts.gate_proj, blk.experts.up_proj, blk.experts.down_proj):
        lin.dot_general = dg
    blk.tile_rows = 8
    x = jnp.asarray(np.random.default_rng(10).normal(size=(21, cfg.hidden_size)).astype(np.float32))

    def run():  # a fresh function per mode: the mode is read when the program is traced
        return nnx.jit(nnx.value_and_grad(lambda m, v: jnp.sum(m(v) ** 2), argnums=(0, 1)))(blk, x)

    with registry.kernel_mode_scope("auto"):
        loss_a, (g_a, gx_a) = run()
    with registry.kernel_mode_scope("xla"):
        loss_x, (g_x, gx_x) = run()
    assert float(loss_a) == float(loss_x)
    np.testing.assert_array_equal(np.asarray(gx_a), np.asarray(gx_x))
    for a, b in zip(jax.tree.leaves(nnx.state(g_a, nnx.Param)), jax.tree.leaves(nnx.state(g_x, nnx.Param))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
