"""Grouped swap-AB W8A8 decode GEMM for MoE experts (Pallas Mosaic GPU, FP8 ``wgmma``): decode-sized routed rows.

Why (issue 37 item 1, the Qwen3-30B-A3B decode shapes): at decode a MoE layer routes ``R = tokens x top_k`` rows
(8 at one token, 256 at 32) over ``E = 128`` experts, so each used expert sees a few rows and the product streams
that expert's weight once: HBM-bound, like a dense decode GEMM. The Pallas-Triton grouped kernel used for these
row counts (:mod:`fp8rl_jax.kernels.pallas_grouped`) quantizes its rows inside every 128-wide K step and runs f16
``mma.sync`` (the design issue 37's H200 profile found at 3-13% of HBM speed in the dense decode kernel). This kernel
is the dense swap-AB decode GEMM (:mod:`fp8rl_jax.kernels.decode_gemm_mgpu`: weight rows as wgmma's A operand,
tokens as its N = 8..64, a TMA ring of K blocks, split-K, promotion per K block) run per tile of the project's expert
tile layout (:func:`fp8rl_jax.models.grouped.tile_layout`: tiles of ``m`` rows, each holding one expert's rows):

* grid ``(N / cta_n, splits, G)``: CTA ``(ni, si, g)`` streams rows ``[ni cta_n, (ni + 1) cta_n)`` of expert
  ``tile_expert[g]``'s ``[N, K]`` e4m3 weight over its split's K blocks against the ``m`` rows of tile ``g``;
* **unused tiles do nothing**: ``G`` is static (at most ``min(R, floor((R + E (m - 1)) / m))``: every used tile
  holds at least one row) but the used count depends on the routing; a tile whose ``tile_expert`` is ``-1`` skips
  its whole pipeline, so no weight of an expert without rows is read, and its partials are zeroed after the kernel;
* activations quantized once per layer outside the kernel (1x128 groups, the ``quant`` family's kernel), as in the
  dense kernel.

Semantics: vLLM's W8A8 blockwise contract per expert, ``y[r, n] = sum_kb (xq[r, kb] . wq[e(r), n, kb]) * xs[r, kb] *
ws[e(r), n // 128, kb]`` (``fused_moe`` with ``block_shape=[128, 128]``), each K block's wgmma partial promoted as in
the dense kernel; the split partials add in XLA.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from fp8rl_jax.fp8.formats import BLOCK_SIZE
from fp8rl_jax.kernels.decode_gemm_mgpu import (HOPPER_SMS, MAX_TOKENS, DecodeGemmConfig, choose_config,
                                                padded_tokens, roofline, swapab_tile)
from fp8rl_jax.kernels.mosaic_gemm import _interpret_params, _pad_to


#: Qwen3-30B-A3B's routed experts per MoE layer
EXPERTS_30B_A3B = 128
#: the Qwen3-30B-A3B expert GEMMs ``(name, N, K)`` per expert (hidden 2048, moe_intermediate 768): gate and up each
#: ``[768, 2048]`` (run as two products on the stacks), down ``[2048, 768]``
QWEN3_30B_A3B_EXPERTS = (("gate", 768, 2048), ("down", 2048, 768))
#: the Mosaic GPU kernel name (``plgpu.kernel(..., kernel_name=...)``)
KERNEL_NAME = "fp8_grouped_decode_gemm_swapab_wgmma"


def expected_tiles(num_rows: int, num_experts: int, tile_rows: int) -> int:
    """The tiles in use expected for ``R`` routed rows: ``min(G, max(ceil(R / m), min(R, E)))`` (one tile per used
    expert when rows are few, all experts used when rows are many; :func:`decode_tiles`' ``G`` bounds it). What
    the default configuration and the roofline record assume; the true count depends on the routing.

    Raises:
      ValueError: as :func:`decode_tiles`."""
    return min(decode_tiles(num_rows, num_experts, tile_rows),
               max(-(-num_rows // tile_rows), min(num_rows, num_experts)))


def decode_tile_rows(num_rows: int, num_experts: int) -> int:
    """Rows per expert tile ``m`` (8..64, a multiple of 8: wgmma's N): twice the mean rows of a used expert,
    ``2 * ceil(R / min(R, E))``, padded (:func:`fp8rl_jax.kernels.decode_gemm_mgpu.padded_tokens`): 8 at one to 32
    tokens of Qwen3-30B-A3B (top-8 of 128), 16 at 128 tokens. An expert with more rows than ``m`` takes several
    tiles, each streaming its weight (from L2 when they run together).

    Raises:
      ValueError: non-positive ``num_rows`` or ``num_experts``."""
    if num_rows <= 0 or num_experts <= 0:
        raise ValueError(f"decode_tile_rows needs positive num_rows and num_experts, got {num_rows}, {num_experts}")
    mean = -(-num_rows // min(num_rows, num_experts))
    return padded_tokens(min(MAX_TOKENS, 2 * mean))


def decode_tiles(num_rows: int, num_experts: int, tile_rows: int) -> int:
    """The static tile count ``G = min(R, floor((R + E (m - 1)) / m))`` of the grouped decode GEMM: the tile
    layout's bound (:func:`fp8rl_jax.models.grouped.num_tiles`), and at most one tile per row (a used tile holds at
    least one); the layout packs its used tiles first, so the first ``G`` are all there can be.

    Raises:
      ValueError: non-positive arguments."""
    if num_rows <= 0 or num_experts <= 0 or tile_rows <= 0:
        raise ValueError(f"decode_tiles needs positive arguments, got {num_rows}, {num_experts}, {tile_rows}")
    return max(1, min(num_rows, (num_rows + num_experts * (tile_rows - 1)) // tile_rows))


def tile_experts(group_sizes: jax.Array, tile_group: jax.Array, num_tiles: int, tile_rows: int) -> jax.Array:
    """The kernel's ``tile_expert`` operand: each of the first ``G`` tiles' expert, ``-1`` past the used ones.

    Args:
      group_sizes: int ``[E]`` routed rows per expert.
      tile_group: int ``[>= G]`` the tile layout's expert of each tile (:func:`fp8rl_jax.models.grouped.tile_layout`,
        which packs the used tiles first, ``ceil(rows / m)`` per expert).
      num_tiles: ``G`` (:func:`decode_tiles`). tile_rows: ``m``.

    Returns:
      int32 ``[G]``: ``tile_group[t]`` for ``t < sum(ceil(group_sizes / m))``, else ``-1`` (the kernel skips those
      tiles and reads no weight for them)."""
    used = jnp.sum((group_sizes.astype(jnp.int32) + tile_rows - 1) // tile_rows)
    return jnp.where(jnp.arange(num_tiles) < used, tile_group[:num_tiles], -1).astype(jnp.int32)


@functools.lru_cache(maxsize=None)
def grouped_decode_config(n: int, k: int, tile_rows: int, num_rows: int, num_experts: int,
                          sms: int = HOPPER_SMS) -> DecodeGemmConfig:
    """The default configuration: :func:`fp8rl_jax.kernels.decode_gemm_mgpu.choose_config` (split-K; no stream-K:
    the used tile count is known only at run time) for the ``N * T`` weight rows of the ``T`` tiles expected in use
    (:func:`expected_tiles`), with 64-row CTAs where ``N`` is not a multiple of theirs. Arithmetic, not a timing: tune on the device.

    Raises:
      ValueError: as :func:`decode_tiles`."""
    cfg = choose_config(n * expected_tiles(num_rows, num_experts, tile_rows), k, tile_rows, sms, stream_k=False)
    return cfg if n % cfg.cta_n == 0 else dataclasses.replace(cfg, compute_wgs=1)  # no padded rows per expert


def _build(np_: int, m_pad: int, kb: int, g: int, cfg: DecodeGemmConfig, interpret):
    """The ``plgpu.kernel``: ``(wq [E, np_, kb*128], xq [g*m_pad, kb*128], xsT [kb, g*m_pad] f32, ws [E, NB, kb] f32,
    tile_expert int32 [g]) -> partials f32 [splits, g, np_, m_pad]`` (unused tiles' partials unwritten)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    nwg, cta_n, splits = cfg.compute_wgs, cfg.cta_n, cfg.splits
    kps = kb // splits

    def body(w_g, x_g, xs_g, ws_g, te_g, o_g):
        ni, si, gi = lax.axis_index("n"), lax.axis_index("s"), lax.axis_index("g")
        e = te_g[gi]

        @pl.when(e >= 0)  # a tile not in use reads no weight
        def _tile():
            swapab_tile(plgpu, pl, cfg, m_pad, kps, interpret, w_g.at[e], ws_g.at[e], x_g, xs_g, gi, o_g.at[si, gi],
                        ni, si * kps)

    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((splits, g, np_, m_pad), jnp.float32),
        grid=(np_ // cta_n, splits, g),
        grid_names=("n", "s", "g"),
        num_threads=nwg + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret if interpret is not None else False,
        kernel_name=KERNEL_NAME,
    )


@functools.partial(jax.jit, static_argnames=("m_pad", "cfg", "out_dtype", "interpret"))
def _grouped(xq, xs, wq, ws, tile_expert, *, m_pad, cfg, out_dtype, interpret):
    e, n, _ = wq.shape
    g = tile_expert.shape[0]
    kb = xs.shape[1]
    kp = kb * BLOCK_SIZE
    np_ = -(-n // cfg.cta_n) * cfg.cta_n
    args = (_pad_to(wq, (e, np_, kp)), _pad_to(xq, (g * m_pad, kp)), _pad_to(xs.T, (kb, g * m_pad)), ws,
            tile_expert.astype(jnp.int32))
    parts = _build(np_, m_pad, kb, g, cfg, _interpret_params(interpret))(*args)  # [S, G, N_pad, m]
    y = jnp.where((tile_expert >= 0)[:, None, None], jnp.sum(parts, axis=0), 0.0)  # unused tiles: never written
    return jnp.swapaxes(y, 1, 2).reshape(g * m_pad, np_)[:, :n].astype(out_dtype)


def grouped_decode_w8a8_matmul(xq: jax.Array, xs: jax.Array, wq: jax.Array, ws: jax.Array, tile_expert: jax.Array, *,
                               tile_rows: int, out_dtype=jnp.float32, interpret=False,
                               config: DecodeGemmConfig | None = None, num_rows: int | None = None) -> jax.Array:
    """W8A8 blockwise FP8 expert products on decode-sized tiles: swap-AB split-K per tile of one expert.

    Row ``r`` of tile ``t = r // tile_rows`` gets ``y[r, n] = sum_kb (xq[r, kb] . wq[e, n, kb]) * xs[r, kb] *
    ws[e, n // 128, kb]`` with ``e = tile_expert[t]`` (vLLM ``fused_moe``, ``block_shape=[128, 128]``); a tile with
    ``tile_expert[t] == -1`` is not computed (its rows are 0).

    Args:
      xq: ``[G * tile_rows, K]`` e4m3 rows in the tile layout (quantized by the caller in 1x128 groups).
      xs: ``[G * tile_rows, ceil(K/128)]`` float32 ``scale_inv``.
      wq: ``[E, N, K]`` e4m3 expert stack; ws: ``[E, ceil(N/128), ceil(K/128)]`` float32 block scales.
      tile_expert: int32 ``[G]``: each tile's expert, ``-1`` for a tile not in use.
      tile_rows: rows per tile (8..64, a multiple of 8). out_dtype: result dtype (the sum is float32).
      interpret: False (compiled for sm_90a) or True (Mosaic GPU's interpreter on the CPU).
      config: :class:`~fp8rl_jax.kernels.decode_gemm_mgpu.DecodeGemmConfig` (split-K only); default
        :func:`grouped_decode_config` for ``num_rows`` routed rows (default ``G * tile_rows``).

    Returns:
      ``[G * tile_rows, N]`` in ``out_dtype``.

    Raises:
      ValueError: shapes or dtypes that do not match (named), ``tile_rows`` not a multiple of 8 in 8..64, a
        stream-K configuration, or one that does not fit (:meth:`DecodeGemmConfig.validate`).
    """
    if wq.ndim != 3 or ws.ndim != 3 or xq.ndim != 2 or xs.ndim != 2 or tile_expert.ndim != 1:
        raise ValueError(f"grouped_decode_w8a8_matmul: expected xq [G*m, K], xs [G*m, KB], wq [E, N, K], "
                         f"ws [E, NB, KB], tile_expert [G]; got {xq.shape}, {xs.shape}, {wq.shape}, {ws.shape}, "
                         f"{tile_expert.shape}")
    if tile_rows not in range(8, MAX_TOKENS + 1, 8):
        raise ValueError(f"grouped_decode_w8a8_matmul: tile_rows must be a multiple of 8 in 8..{MAX_TOKENS}, "
                         f"got {tile_rows}")
    e, n, k = wq.shape
    g = tile_expert.shape[0]
    kb = -(-k // BLOCK_SIZE)
    if xq.shape != (g * tile_rows, k) or xs.shape != (g * tile_rows, kb):
        raise ValueError(f"grouped_decode_w8a8_matmul: {g} tiles of {tile_rows} rows and K={k} need xq "
                         f"{(g * tile_rows, k)} and xs {(g * tile_rows, kb)}, got {xq.shape} and {xs.shape}")
    if ws.shape != (e, -(-n // BLOCK_SIZE), kb):
        raise ValueError(f"grouped_decode_w8a8_matmul: ws must be {(e, -(-n // BLOCK_SIZE), kb)} for wq {wq.shape}, "
                         f"got {ws.shape}")
    for name, a in (("xq", xq), ("wq", wq)):
        if jnp.dtype(a.dtype) != jnp.dtype(jnp.float8_e4m3fn):
            raise ValueError(f"grouped_decode_w8a8_matmul: {name} must be e4m3 (vLLM's W8A8), got {a.dtype}")
    cfg = config or grouped_decode_config(n, kb * BLOCK_SIZE, tile_rows, num_rows or g * tile_rows, e)
    if cfg.stream_k_ctas:
        raise ValueError(f"grouped_decode_w8a8_matmul: split-K configurations only, got {cfg}")
    cfg.validate(tile_rows, kb, n)
    if not isinstance(interpret, bool):
        _interpret_params(interpret)
    return _grouped(xq, xs.astype(jnp.float32), wq, ws.astype(jnp.float32), tile_expert, m_pad=tile_rows, cfg=cfg,
                    out_dtype=jnp.dtype(out_dtype), interpret=interpret)


def grouped_decode_roofline(cfg: DecodeGemmConfig, n: int, k: int, tile_rows: int, tiles_used: int,
                            sms: int = HOPPER_SMS):
    """The :class:`~fp8rl_jax.kernels.decode_gemm_mgpu.Roofline` of the grouped kernel with ``tiles_used`` tiles in
    use: the dense roofline of ``N * tiles_used`` weight rows (the CTAs of unused tiles exit at once)."""
    return roofline(cfg, n * tiles_used, k, tile_rows, sms)


def _selftest_grouped_decode(interpret=False) -> None:
    """Self-test of the ``grouped_decode`` family (this kernel), run once on the GPU on first use: 3 experts of
    ``[100, 300]`` e4m3 (ragged N and K: 2 CTA row blocks of 64, 3 K blocks), 3 tiles of 8 rows (experts 2 and 0,
    and one unused tile) with split-K 3, each tile against the float64 product of its rows with its expert
    (:func:`fp8rl_jax.kernels.pallas_gemm.w8a8_reference`) to ``2**-10`` of the sum of |terms|
    (:data:`fp8rl_jax.kernels.mosaic_gemm.SELFTEST_RTOL`), the unused tile's rows 0. Small on purpose (18 CTAs:
    Mosaic GPU's interpreter takes about half a second per CTA on a CPU); the tile body it shares with the dense
    kernel (:func:`fp8rl_jax.kernels.decode_gemm_mgpu.swapab_tile`) is tested with two warpgroups by that family's
    self-test.

    Raises:
      fp8rl_jax.kernels.registry.KernelMismatch: a result outside the tolerance; a Mosaic GPU compile error unchanged.
    """
    import numpy as np

    from fp8rl_jax.kernels.mosaic_gemm import SELFTEST_RTOL
    from fp8rl_jax.kernels.pallas_gemm import selftest_operands, w8a8_reference
    from fp8rl_jax.kernels.registry import check_close

    m, n, k, experts = 8, 100, 300, np.array([2, 0, -1], np.int32)
    cfg = DecodeGemmConfig(compute_wgs=1, stages=3, splits=3)
    ops = [selftest_operands(len(experts) * m, n, k, seed=1 + 10 * j) for j in range(3)]
    xq, xs = ops[0][1], ops[0][2]
    wq, ws = np.stack([o[3] for o in ops]), np.stack([o[4] for o in ops])
    y = grouped_decode_w8a8_matmul(*(jnp.asarray(a) for a in (xq, xs, wq, ws, experts)), tile_rows=m, config=cfg,
                                   interpret=interpret)
    for t, ex in enumerate(experts):
        rows = slice(t * m, (t + 1) * m)
        if ex < 0:
            ref, bound = np.zeros((m, n)), np.zeros((m, n))
        else:
            ref, bound = w8a8_reference(xq[rows], xs[rows], wq[ex], ws[ex])
        check_close(f"grouped swap-AB decode GEMM tile {t} (expert {ex}) N={n} K={k} {cfg}", y[rows], ref, bound,
                    SELFTEST_RTOL)


def _register_selftest() -> None:
    from fp8rl_jax.kernels.registry import register_selftest

    register_selftest("grouped_decode", _selftest_grouped_decode)


_register_selftest()
