"""The Mosaic GPU (Hopper, FP8 wgmma) blockwise W8A8 GEMM: numerics in Mosaic GPU's interpreter and PTX of a
deviceless sm_90a compile (issue 29).

(a) Numerics. :func:`mosaic_w8a8_matmul` runs in jax's Mosaic GPU interpreter on the CPU (the same kernel body,
the pipeline's TMA copies and barriers simulated) and is compared with a float64 numpy evaluation of
``y[m, n] = sum_kb (xq[m, kb] . wq[n, kb]) * xs[m, kb] * ws[n // 128, kb]`` computed from the e4m3 values
(ml_dtypes) and scales. The operands come from the independent numpy quantizer (tests/fp8_numpy_ref.py) applied
to random data whose magnitude changes by up to e^3 between rows, 128-column groups and 128x128 weight blocks, so
every scale differs and a misplaced scale shows.

Tolerance (a worst-case bound, first order in u = 2**-24, per output element): the kernel rounds (i) the in-block
sum of 128 exact e4m3 products (|error| <= 127 u sum|products| in float32, any order), (ii) the scale product
``xs * ws`` and the scaled partial ``p * s`` (2 u, or 1 u with FMA contraction), (iii) the ``KB - 1`` block
additions into the float32 accumulator (``(KB - 1) u`` of the running sums). All are bounded by
``(128 + KB + 2) u * A``, with ``A[m, n] = sum_kb |xs ws| sum_i |x_i w_i|`` (the reference on absolute values).
A bfloat16 output adds its cast (relative 2**-8, bfloat16's unit roundoff). Measured float32 errors are 100-500x
below this worst-case bound (printed with -s); transposed weight scales give ~7e4x the bound (checked).

On an H100 the in-block wgmma partial is not accumulated in full float32 (DeepSeek-V3: ~14 bits for FP8 wgmma;
the reason for the promotion every 128), so a GPU run needs ``2**-13 * sum_i |x_i w_i|`` for (i) instead: use
:data:`HOPPER_INBLOCK_REL`.

Interpret-mode cost: the interpreter simulates each CTA's warpgroups as Python threads with a callback per memory
operation: ~1 s per CTA of 2-3 K blocks on this 2-core CPU. So the large-M case is M = 1000 (8 CTAs of 128 rows, the
last one ragged: 104 rows) at the smallest N and K that keep the shape ragged (N = 60, K = 200: one N tile, two K
blocks); M = 4096 (32 CTAs, 121 s in CI beside the other worker) added no tile case to it. The 4096^3 shapes are
covered by (b).

(b) Deviceless compile for sm_90a in .venv-cuda (a subprocess: that venv has jax[cuda13]): the PTX must hold
``wgmma.mma_async.sync.aligned.m64n{128,64}k32.f32.e4m3.e4m3`` (FP8 tensor cores, float32 accumulator) and no
``mma.sync``; ptxas (Mosaic GPU's MOSAIC_GPU_DUMP_PTXAS) must report no spills.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import textwrap
import time
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from fp8rl_jax.fp8.formats import CONTRACT
from fp8rl_jax.gpu_target import H100_SXM_TARGET_CONFIG as H100_TARGET_CONFIG
from fp8rl_jax.kernels.mosaic_gemm import (MosaicGemmConfig, batched_w8a8_matmul, default_config, fitted_config,
                                       mosaic_grouped_w8a8_matmul, mosaic_w8a8_matmul)
from fp8_numpy_ref import quantize_blocks

REPO = Path(__file__).resolve().parents[1]
U = 2.0 ** -24
HOPPER_INBLOCK_REL = 2.0 ** -13  # for a future on-device check (see the module docstring)
E4M3, E5M2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2


def _operands(m, n, k, seed, fp8="e4m3"):
    """Quantized operands (numpy): ``xq [m, k], xs [m, KB], wq [n, k], ws [NB, KB]``."""
    rng = np.random.default_rng(seed)
    kb, nb = -(-k // 128), -(-n // 128)
    x = rng.standard_normal((m, k)) * np.exp(rng.uniform(-3, 3, (m, 1)))
    x *= np.repeat(np.exp(rng.uniform(-3, 3, (1, kb))), 128, axis=1)[:, :k]
    w = rng.standard_normal((n, k)) * 0.05
    w *= np.kron(np.exp(rng.uniform(-3, 3, (nb, kb))), np.ones((128, 128)))[:n, :k]
    fmax = 448.0 if fp8 == "e4m3" else 57344.0
    xq, xs = quantize_blocks(x.astype(np.float32), 1, 128, CONTRACT, fp8_max=fmax)
    wq, ws = quantize_blocks(w.astype(np.float32), 128, 128, CONTRACT, fp8_max=fmax)
    if fp8 == "e5m2":  # the reference quantizer casts to e4m3; recast from the same float32 values to e5m2
        xq = np.clip(x.astype(np.float32) / np.repeat(xs, 128, axis=1)[:, :k], -fmax, fmax).astype(E5M2)
        wsf = np.kron(ws, np.ones((128, 128), np.float32))[:n, :k]
        wq = np.clip(w.astype(np.float32) / wsf, -fmax, fmax).astype(E5M2)
    return xq, xs, wq, ws


def _reference(xq, xs, wq, ws):
    """float64 ``(y, A)``: the formula and its absolute-value twin (the tolerance's scale)."""
    m, k = xq.shape
    n = wq.shape[0]
    kb = xs.shape[1]
    x = np.zeros((m, kb * 128))
    w = np.zeros((n, kb * 128))
    x[:, :k] = xq.astype(np.float64)
    w[:, :k] = wq.astype(np.float64)
    x, w = x.reshape(m, kb, 128), w.reshape(n, kb, 128)
    s = xs.astype(np.float64)[:, None, :] * np.repeat(ws.astype(np.float64), 128, axis=0)[None, :n, :]  # [m, n, kb]
    y = np.einsum("mkb,nkb,mnk->mn", x, w, s)
    a = np.einsum("mkb,nkb,mnk->mn", np.abs(x), np.abs(w), np.abs(s))
    return y, a


def _tolerance(a, kb, y_ref=None, out_dtype=np.float32):
    tol = (128 + kb + 2) * U * a
    if out_dtype != np.float32:
        tol = tol + 2.0 ** -8 * (np.abs(y_ref) + tol)  # bf16 cast of the float32 result: u = 2**-8
    return tol


def _run(xq, xs, wq, ws, **kw):
    return np.asarray(mosaic_w8a8_matmul(jnp.asarray(xq), jnp.asarray(xs), jnp.asarray(wq), jnp.asarray(ws),
                                         interpret=True, **kw), np.float64)


def _ratio(y, y_ref, tol):
    return float(np.max(np.abs(y - y_ref) / np.maximum(tol, np.finfo(np.float64).tiny)))


@pytest.mark.parametrize("m,n,k", [(1, 100, 300), (17, 100, 300), (64, 100, 300), (65, 100, 300), (300, 100, 300),
                                   (1000, 60, 200)])
def test_interpret_matches_float64_reference(m, n, k):
    """Ragged M (1 / 17 / 64 / 65 take the 64x64 tiles of M < 128, 300 / 1000 the 128x128 tiles of large GEMMs), N
    and K not multiples of the tiles (zero padding; the last K group is 44 or 72 wide). M = 1000 at a small N and K
    (see the module docstring: interpret-mode cost)."""
    xq, xs, wq, ws = _operands(m, n, k, seed=m)
    t = time.perf_counter()
    # M >= 128 at these small N would default to the 64 x 64 tiles (fewer 128 x 128 CTAs than SMs): ask for the
    # 128 x 128 configuration of large GEMMs explicitly
    y = _run(xq, xs, wq, ws, config=fitted_config() if m >= 128 else None)
    y_ref, a = _reference(xq, xs, wq, ws)
    tol = _tolerance(a, xs.shape[1])
    r = _ratio(y, y_ref, tol)
    print(f"M={m}: max |err| / bound = {r:.3g}, max |err| = {np.max(np.abs(y - y_ref)):.3g}, "
          f"max |y| = {np.max(np.abs(y_ref)):.3g} ({time.perf_counter() - t:.1f} s)")
    assert y.shape == (m, n)
    assert r <= 1.0


def test_interpret_several_weight_scale_rows_and_wrong_scales_fail():
    """N = K = 256 (two weight-scale rows and K blocks, 128x128 tiles): matches; the same kernel fed the
    transposed weight scales (a plausible layout bug: ``ws[kb, nb]`` for ``ws[nb, kb]``) misses the bound by far."""
    m, n, k = 65, 256, 256
    xq, xs, wq, ws = _operands(m, n, k, seed=7)
    y_ref, a = _reference(xq, xs, wq, ws)
    tol = _tolerance(a, xs.shape[1])
    good = _ratio(_run(xq, xs, wq, ws), y_ref, tol)
    bad = _ratio(_run(xq, xs, wq, np.ascontiguousarray(ws.T)), y_ref, tol)
    print(f"N=K=256: correct scales {good:.3g} x bound, transposed weight scales {bad:.3g} x bound")
    assert not np.allclose(ws, ws.T)
    assert good <= 1.0
    assert bad > 100.0


def test_interpret_e5m2_bf16_output():
    """Both operands e5m2 (FP8 training's gradient format), bfloat16 output through SMEM + TMA."""
    m, n, k = 64, 200, 256
    xq, xs, wq, ws = _operands(m, n, k, seed=3, fp8="e5m2")
    y = _run(xq, xs, wq, ws, out_dtype=jnp.bfloat16)
    y_ref, a = _reference(xq, xs, wq, ws)
    r = _ratio(y, y_ref, _tolerance(a, xs.shape[1], y_ref, out_dtype=jnp.bfloat16))
    print(f"e5m2 x e5m2 -> bf16: max |err| / bound = {r:.3g}")
    assert r <= 1.0


def test_interpret_grouped_matches_per_expert_reference():
    """MoE variant: 4 tiles of 64 rows for experts (2, 0, 0, 1) of 3; each row against its expert's weight."""
    e, n, k, tile_rows = 3, 200, 300, 64
    tile_group = np.array([2, 0, 0, 1], np.int32)
    t = tile_group.size * tile_rows
    xq, xs, _, _ = _operands(t, n, k, seed=11)
    ws_all, wq_all = [], []
    for j in range(e):
        _, _, wq, ws = _operands(1, n, k, seed=20 + j)
        wq_all.append(wq)
        ws_all.append(ws)
    wq, ws = np.stack(wq_all), np.stack(ws_all)
    y = np.asarray(mosaic_grouped_w8a8_matmul(jnp.asarray(xq), jnp.asarray(xs), jnp.asarray(wq), jnp.asarray(ws),
                                              jnp.asarray(tile_group), tile_rows=tile_rows, interpret=True))
    worst = 0.0
    for i, g in enumerate(tile_group):
        rows = slice(i * tile_rows, (i + 1) * tile_rows)
        y_ref, a = _reference(xq[rows], xs[rows], wq[g], ws[g])
        worst = max(worst, _ratio(y[rows], y_ref, _tolerance(a, xs.shape[1])))
    print(f"grouped: max |err| / bound = {worst:.3g}")
    assert worst <= 1.0


def _row_reference(xq, xs, wq, ws_rows):
    """float64 ``(y, A)`` of the 1D1D formula ``sum_kb (xq . wq) * xs[m, kb] * ws[n, kb]`` (B in 1x128 row groups)."""
    k = xq.shape[1]
    xd = xq.astype(np.float64) * np.repeat(xs.astype(np.float64), 128, axis=1)[:, :k]
    wd = wq.astype(np.float64) * np.repeat(ws_rows.astype(np.float64), 128, axis=1)[:, :k]
    return xd @ wd.T, np.abs(xd) @ np.abs(wd).T


def test_interpret_batched_row_and_block_scales():
    """:func:`batched_w8a8_matmul` (FP8 training's products on MoE expert tiles: one weight per batch, the grouped
    kernel with ``tile_group = arange(B)``) at B = 2, M = 40 (padded to 64 rows per batch), N = 60, K = 200: with
    B's scales in 1x128 row groups (``w_scales="row"``, the weight gradient's 1D1D form) and in 128x128 blocks, each
    batch against its own float64 reference."""
    b, m, n, k = 2, 40, 60, 200
    ops = [_operands(m, n, k, seed=40 + i) for i in range(b)]
    xq, xs = np.stack([o[0] for o in ops]), np.stack([o[1] for o in ops])
    wq, ws = np.stack([o[2] for o in ops]), np.stack([o[3] for o in ops])
    # row scales: B quantized in 1x128 groups by the numpy quantizer (the other operand's activations stand in)
    rows = [_operands(n, 8, k, seed=50 + i) for i in range(b)]
    wq_r, ws_r = np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])
    worst = {}
    for how, w_q, w_s in (("row", wq_r, ws_r), ("block", wq, ws)):
        y = np.asarray(batched_w8a8_matmul(*(jnp.asarray(a) for a in (xq, xs, w_q, w_s)), interpret=True,
                                           w_scales=how), np.float64)
        assert y.shape == (b, m, n)
        for i in range(b):
            y_ref, a = (_row_reference if how == "row" else _reference)(xq[i], xs[i], w_q[i], w_s[i])
            worst[how] = max(worst.get(how, 0.0), _ratio(y[i], y_ref, _tolerance(a, xs.shape[2])))
    print(f"batched: max |err| / bound = {worst}")
    assert max(worst.values()) <= 1.0


@pytest.mark.parametrize("m,n,w_scales,out_dtype,blocks,stages", [(300, 200, "block", jnp.bfloat16, 1, 2),
                                                                    (200, 390, "row", jnp.float32, 1, 2),
                                                                    (300, 200, "block", jnp.bfloat16, 2, 1),
                                                                    (200, 200, "row", jnp.bfloat16, 2, 1)])
def test_interpret_persistent_grid_matches_float64_reference(m, n, w_scales, out_dtype, blocks, stages):
    """The persistent grid (issue 37 item 2: :attr:`MosaicGemmConfig.persistent_ctas`): 5 CTAs loop over the
    3 x 2, 2 x 4 or 2 x 2 output tiles of a ragged product (K = 300: 3 K blocks, the last 44 wide) in snake bands of 2
    M tiles, so CTAs take one or two tiles each and a band ends inside a column; the TMA ring (2 stages, or 1 of two
    blocks) is reused across tiles at a K step count that is not a multiple of it, as at the real shapes (32 or 96
    blocks in 5 stages). Every tile must hold the float64 formula (a tile skipped, placed at the wrong (m, n), or
    reading a stale ring slot misses by orders of magnitude), and the block-scale cases must equal the
    one-tile-per-CTA, one-block-per-step kernel bit for bit (same per-tile arithmetic). ``blocks=2``: two K blocks
    per pipeline step (:attr:`MosaicGemmConfig.blocks_per_step`), each promoted with its own scales; the 3 blocks
    zero-padded to 2 steps, with block and row scales. Not checkable here: the order of a tile's TMA store against
    the next tile's rewrite of the output buffer (the interpreter copies synchronously; the GPU self-test and the
    tuner's output comparison cover it on a device)."""
    k = 300
    import dataclasses

    xq, xs, wq, ws = _operands(m, n, k, seed=11)
    if w_scales == "row":  # 1x128 groups of B: one scale per weight row and K block
        ws = np.repeat(ws, 128, axis=0)[:n] * np.exp(np.random.default_rng(12).uniform(-1, 1, (n, 1)))
        ws = ws.astype(np.float32)
    base = fitted_config(out_dtype=out_dtype, w_scales=w_scales, blocks_per_step=blocks)
    cfg = dataclasses.replace(base, stages=stages, persistent_ctas=5, grid_tile_width=2)
    y = _run(xq, xs, wq, ws, config=cfg, out_dtype=out_dtype, w_scales=w_scales)
    y_ref, a = (_row_reference if w_scales == "row" else _reference)(xq, xs, wq, ws)
    r = _ratio(y, y_ref, _tolerance(a, xs.shape[1], y_ref, np.dtype(out_dtype)))
    print(f"persistent {m}x{n}x{k} {w_scales} {np.dtype(out_dtype)} blocks={blocks}, {cfg.stages} stages: "
          f"max |err| / bound = {r:.3g}")
    assert y.shape == (m, n) and r <= 1.0
    if w_scales == "block":
        np.testing.assert_array_equal(y, _plain_run(m, n, k, 11, np.dtype(out_dtype).name))


@functools.lru_cache(maxsize=None)
def _plain_run(m, n, k, seed, out_dtype):
    """The one-tile-per-CTA, one-block-per-step kernel's result on :func:`_operands` (computed once per case)."""
    xq, xs, wq, ws = _operands(m, n, k, seed=seed)
    return _run(xq, xs, wq, ws, config=fitted_config(out_dtype=out_dtype), out_dtype=out_dtype)


def test_prefill_tuner_candidates_and_choice(monkeypatch, tmp_path):
    """The prefill GEMM's on-device tuning (issue 37 items 2, 3): without a CUDA device :func:`tuned_config` is
    :func:`default_config`'s (and so is the kernel's config); the candidates are valid, distinct, the default first,
    with the persistent grid among them. With a (fake) CUDA device and an injected timer each candidate is run (in
    the interpreter here), checked against the default's output and timed; the fastest is kept and persists."""
    from fp8rl_jax.kernels import mosaic_gemm as mg
    from conftest import fake_cuda_tuner
    from fp8rl_jax.kernels import registry, tuner

    monkeypatch.setenv("FP8RL_AUTOTUNE_CACHE", str(tmp_path))
    monkeypatch.setenv("FP8RL_AUTOTUNE_BUDGET_S", "900")  # interpret mode on this CPU, not a GPU
    monkeypatch.setattr(tuner, "_SHIPPED_ROOT", tmp_path / "shipped")  # no shipped table decides here
    monkeypatch.setattr(registry, "cuda_device", lambda: None)  # first: no CUDA device, whatever this machine has
    tuner.reset()
    m, n, k = 3, 128, 256
    cands = mg.candidate_configs(m, n)
    assert cands[0] == default_config(m, n=n) and len(set(cands)) == len(cands) >= 3
    assert any(c.persistent_ctas for c in cands)
    assert len({mg.config_name(c) for c in cands}) == len(cands)
    assert mg.tuned_config(m, n, k) == cands[0]
    assert mg.tuned_config(4096, 24576, 4096, jnp.bfloat16) == default_config(4096, jnp.bfloat16, n=24576)

    timed = []

    def timer(fn, args):
        timed.append(1)
        return 1e-6 if len(timed) == len(cands) else 1e-3  # the last candidate timed is the fastest

    real = mg._dense
    monkeypatch.setattr(mg, "_dense", lambda *a, **kw: real(*a, **dict(kw, interpret=True)))
    select = tuner.select
    fake_cuda_tuner(monkeypatch, timer, core_count=114)  # an H100 PCIe: persistent grids of one CTA per SM
    tuner.reset()
    with tuner.autotune_mode_scope("on"):
        got = mg.tuned_config(m, n, k)
    # every configuration and XLA's own path (timed last) were timed
    assert got.persistent_ctas == 114 and len(timed) == len(cands) + 1, (got, tuner.report())
    cands = mg.candidate_configs(m, n, sms=114)
    assert got == cands[-1]
    assert any(r["op"] == "w8a8_gemm" and r["choice"] == mg.config_name(cands[-1]) and mg.XLA_CANDIDATE in
               r["timings_us"] for r in tuner.report())
    stored = list(tmp_path.rglob("w8a8_gemm.json"))
    assert len(stored) == 1 and mg.config_name(cands[-1]) in stored[0].read_text()
    tuner.reset()  # a new process: the stored choice, nothing timed
    try:
        with tuner.autotune_mode_scope("cached"):
            assert mg.tuned_config(m, n, k) == cands[-1] and len(timed) == len(cands) + 1
        # an e5m2 product or a large M is another key: nothing stored for it, the default
        keys = []
        monkeypatch.setattr(tuner, "select", lambda op, key, c, *a, **kw: keys.append(key) or select(op, key, c, *a,
                                                                                                     **kw))
        with tuner.autotune_mode_scope("cached"):
            assert mg.tuned_config(m, n, k, op_dtype=jnp.float8_e5m2) == cands[0]
            assert mg.tuned_config(20000, n, k) == default_config(20000, n=n)
        assert keys[0]["dtype"] == "float8_e5m2" and keys[1]["M>"] == mg.MAX_TUNE_ROWS and "M<=" not in keys[1]
    finally:
        tuner.reset()



def test_default_config_by_m():
    """M < 128: 64-row CTAs with 64-column tiles (the 64 < M < 128 band streams the weight: more CTAs); M >= 128:
    128 x 128 (two compute warpgroups) when that grid occupies at least half of the SMs. Row scales fit the same
    rings (512 B more per stage)."""
    for m, (cta_m, tile_n) in ((1, (64, 64)), (64, (64, 64)), (65, (64, 64)), (127, (64, 64)), (128, (128, 128)),
                               (4096, (128, 128))):
        cfg = default_config(m)
        assert (cfg.cta_m, cfg.tile_n) == (cta_m, tile_n), m
    # with N: 128 x 128 only when its grid occupies at least half of the 132 SMs (decode at batch 128, N = 4096:
    # 32 CTAs -> 64 x 64)
    assert default_config(128, n=4096).cta_m == 64 and default_config(4096, n=4096).cta_m == 128
    assert default_config(256, n=4096).cta_m == 64 and default_config(384, n=4096).cta_m == 128  # 64 / 96 CTAs
    assert default_config(4096, w_scales="row").stages == 4
    default_config(4096, w_scales="row").validate(jnp.float32, "row")


# ----------------------------------------------------------------------------------------------------------
# Argument checks (no kernel runs).


def _zeros(shape, dtype):
    return jnp.zeros(shape, dtype)


def test_errors():
    xq, xs = _zeros((8, 256), jnp.float8_e4m3fn), _zeros((8, 2), jnp.float32)
    wq, ws = _zeros((128, 256), jnp.float8_e4m3fn), _zeros((1, 2), jnp.float32)
    with pytest.raises(ValueError, match="K mismatch"):
        mosaic_w8a8_matmul(xq, xs, _zeros((128, 384), jnp.float8_e4m3fn), _zeros((1, 3), jnp.float32))
    with pytest.raises(ValueError, match="xs must be"):
        mosaic_w8a8_matmul(xq, _zeros((8, 3), jnp.float32), wq, ws)
    with pytest.raises(ValueError, match="ws must be"):
        mosaic_w8a8_matmul(xq, xs, wq, _zeros((2, 1), jnp.float32))
    with pytest.raises(ValueError, match="float8"):
        mosaic_w8a8_matmul(xq.astype(jnp.bfloat16), xs, wq, ws)
    with pytest.raises(ValueError, match="scale"):
        mosaic_w8a8_matmul(xq, xs.astype(jnp.int32), wq, ws)
    with pytest.raises(NotImplementedError, match="same element type"):
        mosaic_w8a8_matmul(xq.astype(jnp.float8_e5m2), xs, wq, ws)
    with pytest.raises(ValueError, match="block_size"):
        mosaic_w8a8_matmul(xq, _zeros((8, 4), jnp.float32), wq, _zeros((2, 4), jnp.float32), block_size=64)
    with pytest.raises(ValueError, match="out_dtype"):
        mosaic_w8a8_matmul(xq, xs, wq, ws, out_dtype=jnp.int32)
    with pytest.raises(ValueError, match="shared memory"):
        mosaic_w8a8_matmul(xq, xs, wq, ws, config=MosaicGemmConfig(stages=5))  # 128x128, f32 out: 4 fit
    with pytest.raises(ValueError, match="tile_n"):
        mosaic_w8a8_matmul(xq, xs, wq, ws, config=MosaicGemmConfig(tile_n=256))
    with pytest.raises(ValueError, match="w_scales must be one of"):
        mosaic_w8a8_matmul(xq, xs, wq, ws, w_scales="column")
    with pytest.raises(ValueError, match=r"w_scales='row' ws must be \[N"):
        mosaic_w8a8_matmul(xq, xs, wq, ws, w_scales="row")
    with pytest.raises(ValueError, match="one batch size"):
        batched_w8a8_matmul(xq[None], xs[None], jnp.stack([wq, wq]), jnp.stack([ws, ws]))
    assert mosaic_w8a8_matmul(xq[:0], xs[:0], wq, ws).shape == (0, 128)  # no rows: no kernel
    tg = jnp.zeros((1,), jnp.int32)
    w3, s3 = wq[None], ws[None]
    with pytest.raises(ValueError, match="multiple of 64"):
        mosaic_grouped_w8a8_matmul(xq, xs, w3, s3, tg, tile_rows=8)
    with pytest.raises(ValueError, match="tiles of"):
        mosaic_grouped_w8a8_matmul(_zeros((128, 256), jnp.float8_e4m3fn), _zeros((128, 2), jnp.float32), w3, s3,
                                   tg, tile_rows=64)


def test_fitted_config_fits_and_matches_the_measured_limit():
    """4 stages of 128x128 tiles with float32 output, 5 with bfloat16: the deviceless compile accepted those
    and refused 5 stages with float32 output (232528 B > 232448 B)."""
    assert fitted_config(out_dtype=jnp.float32).stages == 4
    assert fitted_config(out_dtype=jnp.bfloat16).stages == 5
    for cfg in (fitted_config(out_dtype=jnp.float32), fitted_config(tile_n=64, compute_wgs=1)):
        cfg.validate(jnp.float32)


# ----------------------------------------------------------------------------------------------------------
# (b) Deviceless compile for sm_90a.


# name: (M, N, K, operand dtype, out dtype, grouped experts or 0, expected wgmma form)
COMPILE_CASES = {
    "4096^3_e4m3_f32": (4096, 4096, 4096, "float8_e4m3fn", "float32", 0, "m64n128k32.f32.e4m3.e4m3"),
    "4096^3_e4m3_bf16": (4096, 4096, 4096, "float8_e4m3fn", "bfloat16", 0, "m64n128k32.f32.e4m3.e4m3"),
    # 3 x 8 = 24 CTAs of 128 x 128 would leave most of the 132 SMs idle: default_config takes 64 x 64 tiles
    "ragged_300x1000x1000": (300, 1000, 1000, "float8_e4m3fn", "float32", 0, "m64n64k32.f32.e4m3.e4m3"),
    "decode_M1_4096^2_bf16": (1, 4096, 4096, "float8_e4m3fn", "bfloat16", 0, "m64n64k32.f32.e4m3.e4m3"),
    "4096^3_e5m2_f32": (4096, 4096, 4096, "float8_e5m2", "float32", 0, "m64n128k32.f32.e5m2.e5m2"),
    "grouped_E8_5120x768x2048_bf16": (5120, 768, 2048, "float8_e4m3fn", "bfloat16", 8, "m64n128k32.f32.e4m3.e4m3"),
    # the persistent grid (issue 37 item 2): Qwen3-8B's down_proj prefill on 132 CTAs
    "persistent_4096x4096x12288_bf16": (4096, 4096, 12288, "float8_e4m3fn", "bfloat16", 0,
                                        "m64n128k32.f32.e4m3.e4m3"),
    # and two K blocks per step: the second block's wgmma runs while the first is promoted (wait_group 1)
    "persistent_2blocks_4096x4096x12288_bf16": (4096, 4096, 12288, "float8_e4m3fn", "bfloat16", 0,
                                                "m64n128k32.f32.e4m3.e4m3"),
    "row_2blocks_4096x4096x4096_f32": (4096, 4096, 4096, "float8_e4m3fn", "float32", 0, "m64n128k32.f32.e4m3.e4m3"),
}
#: configurations of the cases not compiled with the default one (``MosaicGemmConfig`` fields)
CASE_CONFIGS = {"persistent_4096x4096x12288_bf16": {"tile_n": 128, "compute_wgs": 2, "stages": 5,
                                                    "persistent_ctas": 132, "grid_tile_width": 8},
                "persistent_2blocks_4096x4096x12288_bf16": {"tile_n": 128, "compute_wgs": 2, "stages": 2,
                                                            "persistent_ctas": 132, "blocks_per_step": 2},
                # FP8 training's weight gradient: 1x128 row scales of B ("w_scales" is the call's, not a field)
                "row_2blocks_4096x4096x4096_f32": {"tile_n": 128, "compute_wgs": 2, "stages": 2,
                                                   "blocks_per_step": 2, "w_scales": "row"}}

_COMPILE_SCRIPT = textwrap.dedent("""
    import json, os, sys, time
    os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
    os.environ["MOSAIC_GPU_DUMP_PTX"] = "1"
    os.environ["MOSAIC_GPU_DUMP_PTXAS"] = "1"
    import jax, jax.numpy as jnp
    from jax.experimental import topologies
    from jax.sharding import NamedSharding, PartitionSpec as P
    from fp8rl_jax.kernels.mosaic_gemm import MosaicGemmConfig, mosaic_grouped_w8a8_matmul, mosaic_w8a8_matmul

    cases, target, out_dir, configs = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    topo = topologies.get_topology_desc(platform="cuda", target_config=target, topology="1x1x1")
    mesh = topologies.make_mesh(topo, (1,), ("x",))
    sds = lambda s, d: jax.ShapeDtypeStruct(s, jnp.dtype(d), sharding=NamedSharding(mesh, P()))
    for name, (m, n, k, op, out, experts, _) in cases.items():
        d = os.path.join(out_dir, name)
        os.makedirs(d)
        os.environ["MOSAIC_GPU_DUMP_TO"] = d  # read at each Mosaic GPU compile
        kb, nb = -(-k // 128), -(-n // 128)
        if experts:
            tile_rows = 128
            f = lambda a, b, c, e, g: mosaic_grouped_w8a8_matmul(a, b, c, e, g, tile_rows=tile_rows, out_dtype=out)
            args = (sds((m, k), op), sds((m, kb), "float32"), sds((experts, n, k), op),
                    sds((experts, nb, kb), "float32"), sds((m // tile_rows,), "int32"))
        else:
            fields = dict(configs.get(name, {}))
            ws_mode = fields.pop("w_scales", "block")
            cfg = MosaicGemmConfig(**fields) if fields else None
            f = lambda a, b, c, e: mosaic_w8a8_matmul(a, b, c, e, out_dtype=out, config=cfg, w_scales=ws_mode)
            args = (sds((m, k), op), sds((m, kb), "float32"), sds((n, k), op),
                    sds((n if ws_mode == "row" else nb, kb), "float32"))
        t = time.perf_counter()
        jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).compile()
        print(f"compiled {name} in {time.perf_counter() - t:.1f} s", flush=True)
""")


@pytest.fixture(scope="module")
def sm90a_dumps(tmp_path_factory):
    """Compile every case of :data:`COMPILE_CASES` for sm_90a in .venv-cuda; ``{name: (ptx, ptxas)}``."""
    from conftest import require_cuda_venv

    cuda_py = require_cuda_venv()
    out = tmp_path_factory.mktemp("mosaic_sm90a")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for var in ("JAX_PLATFORMS", "XLA_FLAGS", "MOSAIC_GPU_DUMP_TO", "JAX_COMPILATION_CACHE_DIR"):
        env.pop(var, None)
    proc = subprocess.run([cuda_py, "-c", _COMPILE_SCRIPT, json.dumps(COMPILE_CASES), H100_TARGET_CONFIG,
                           str(out), json.dumps(CASE_CONFIGS)], env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    print(proc.stdout)
    dumps = {}
    for name in COMPILE_CASES:
        d = out / name
        ptx = [p for p in d.iterdir() if p.suffix == ".ptx"]
        assert len(ptx) == 1, f"{name}: expected one Mosaic GPU kernel, found {sorted(p.name for p in d.iterdir())}"
        ptxas = ptx[0].with_suffix(".ptxas")
        dumps[name] = (ptx[0].read_text(), ptxas.read_text() if ptxas.exists() else None)
    return dumps


@pytest.mark.parametrize("name", list(COMPILE_CASES))
def test_sm90a_ptx_uses_fp8_wgmma(sm90a_dumps, name):
    ptx, ptxas = sm90a_dumps[name]
    form = COMPILE_CASES[name][-1]
    assert ".target sm_90a" in ptx
    assert f"wgmma.mma_async.sync.aligned.{form}" in ptx, f"{name}: no {form} wgmma"
    assert "mma.sync" not in ptx, f"{name}: falls back to mma.sync"
    if COMPILE_CASES[name][4] == "bfloat16":
        assert "cvt.rn.bf16x2.f32" in ptx and "cp.async.bulk.tensor" in ptx  # bf16 epilogue, TMA store
    if name in CASE_CONFIGS and CASE_CONFIGS[name].get("persistent_ctas"):
        assert ".entry fp8_blockwise_gemm_wgmma_persistent_" in ptx  # the persistent kernel was the one compiled
    if CASE_CONFIGS.get(name, {}).get("blocks_per_step", 1) == 2:  # block 1's wgmma in flight while block 0 promotes
        assert "wgmma.wait_group.sync.aligned \t1;" in ptx and "wgmma.wait_group.sync.aligned \t0;" in ptx
    if ptxas is not None:
        assert "0 bytes spill stores" in ptxas, ptxas
        print(name, [line.strip() for line in ptxas.splitlines() if "Used" in line or "spill" in line])
