"""The grouped swap-AB decode GEMM for MoE experts (fp8rl_jax/kernels/decode_grouped_mgpu.py, issue 37 item 1).

Numerics in Mosaic GPU's interpreter are tested twice elsewhere: its self-test against the float64 product of each
tile with its expert (tests/test_kernel_choice.py, ``grouped_decode``: two experts, an unused tile, split-K, ragged
N and K), and the MoE block on it against the float64 per-token reference (tests/test_moe.py, ``swapab``). Its
sm_90a compile and roofline record: ``scripts/compile_h100.py``'s ``decode_experts_*`` programs (make test's lane).
Here: the tile arithmetic by hand, and the errors.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from fp8rl_jax.kernels import decode_grouped_mgpu as dgm
from fp8rl_jax.kernels.decode_gemm_mgpu import DecodeGemmConfig


def test_tile_rows_and_counts_by_hand():
    # Qwen3-30B-A3B, 128 experts, top-8: 1 token = 8 rows (8 experts, one row each: 8-row tiles, at most 8 tiles);
    # 32 tokens = 256 rows (mean 2 per used expert -> 8-row tiles; (256 + 128 * 7) // 8 = 144 tiles at most);
    # 128 tokens = 1024 rows (mean 8 -> 16-row tiles; (1024 + 128 * 15) // 16 = 184)
    assert [dgm.decode_tile_rows(r, 128) for r in (8, 256, 1024)] == [8, 8, 16]
    assert [dgm.decode_tiles(r, 128, m) for r, m in ((8, 8), (256, 8), (1024, 16))] == [8, 144, 184]
    # expected in use: one tile per used expert when rows are few (8; 128), else ceil(R / m) (1024 / 16 = 64 < 128)
    assert [dgm.expected_tiles(r, 128, m) for r, m in ((8, 8), (256, 8), (1024, 16))] == [8, 128, 128]
    assert dgm.decode_tile_rows(64 * 4, 4) == 64  # mean 64 rows per expert: capped at the kernel's 64
    assert dgm.decode_tiles(3, 128, 8) == 3  # never more tiles than rows
    for bad in ((0, 128), (8, 0)):
        with pytest.raises(ValueError, match="positive"):
            dgm.decode_tile_rows(*bad)


def test_default_configuration_fills_the_sms_for_the_expected_tiles():
    """Qwen3-30B-A3B's expert gate (768 x 2048) at one token: 8 tiles x 768 rows; down (2048 x 768)."""
    for n, k in ((768, 2048), (2048, 768)):
        cfg = dgm.grouped_decode_config(n, k, 8, 8, 128)
        ctas = n // cfg.cta_n * 8 * cfg.splits  # by hand: N tiles x 8 used expert tiles x splits, one CTA per SM
        eff = ctas / (math.ceil(ctas / 132) * 132)
        ring = min(cfg.stages, k // 128 // cfg.splits) * ((cfg.cta_n + 8) * 128 + 4 * 8)  # the TMA ring's bytes
        assert cfg.stream_k_ctas == 0 and eff >= 0.9 and ring >= 24576, (n, k, cfg, ctas)
        r = dgm.grouped_decode_roofline(cfg, n, k, 8, 8)
        assert (r.grid, round(r.wave_efficiency, 6), r.bytes_in_flight_per_sm) == (
            (n // cfg.cta_n * 8, cfg.splits), round(eff, 6), ring)
    # N not a multiple of 128: 64-row CTAs, so no expert's rows are padded
    assert dgm.grouped_decode_config(192, 256, 8, 8, 8).compute_wgs == 1


def test_bad_operands_are_named():
    e, n, k, m, g = 3, 128, 256, 8, 2
    xq = jnp.zeros((g * m, k), jnp.float8_e4m3fn)
    xs = jnp.ones((g * m, k // 128), jnp.float32)
    wq = jnp.zeros((e, n, k), jnp.float8_e4m3fn)
    ws = jnp.ones((e, 1, 2), jnp.float32)
    te = jnp.asarray(np.array([0, -1], np.int32))
    call = dgm.grouped_decode_w8a8_matmul
    with pytest.raises(ValueError, match="tile_rows must be a multiple of 8"):
        call(xq, xs, wq, ws, te, tile_rows=12, interpret=True)
    with pytest.raises(ValueError, match=r"2 tiles of 8 rows and K=256 need xq \(16, 256\)"):
        call(xq[:8], xs[:8], wq, ws, te, tile_rows=8, interpret=True)
    with pytest.raises(ValueError, match=r"ws must be \(3, 1, 2\)"):
        call(xq, xs, wq, ws[:, :, :1], te, tile_rows=8, interpret=True)
    with pytest.raises(ValueError, match="wq must be e4m3"):
        call(xq, xs, wq.astype(jnp.float8_e5m2), ws, te, tile_rows=8, interpret=True)
    with pytest.raises(ValueError, match=r"expected xq \[G\*m, K\]"):
        call(xq, xs, wq[0], ws, te, tile_rows=8, interpret=True)
    with pytest.raises(ValueError, match="split-K configurations only"):
        call(xq, xs, wq, ws, te, tile_rows=8, interpret=True, config=DecodeGemmConfig(compute_wgs=1, stream_k_ctas=4))
    with pytest.raises(ValueError, match="splits=3 must divide"):
        call(xq, xs, wq, ws, te, tile_rows=8, interpret=True, config=DecodeGemmConfig(compute_wgs=1, splits=3))


def test_tile_experts_marks_the_tiles_past_the_used_ones():
    """Routed rows per expert [3, 0, 9, 1] at m = 8 take ceil(3/8) + 0 + ceil(9/8) + ceil(1/8) = 4 tiles, packed
    first by the layout (expert 0, expert 2 twice, expert 3); of G = 6 tiles the last two are unused (-1)."""
    sizes = jnp.asarray([3, 0, 9, 1], jnp.int32)
    tile_group = jnp.asarray([0, 2, 2, 3, 3, 3, 3], jnp.int32)  # tile_layout's tiles past the used ones: last group
    got = np.asarray(dgm.tile_experts(sizes, tile_group, 6, 8))
    assert got.dtype == np.int32 and got.tolist() == [0, 2, 2, 3, -1, -1]
    assert np.asarray(dgm.tile_experts(sizes, tile_group, 3, 8)).tolist() == [0, 2, 2]  # G below the used count
