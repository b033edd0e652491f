"""Blockwise-scaled FP8 GEMM for Hopper (sm_90a) with Pallas Mosaic GPU: real FP8 ``wgmma`` (issue 29).

Why: the project's Pallas-Triton W8A8 GEMM (:mod:`fp8rl_jax.kernels.pallas_gemm`) compiles on sm_90a to f16
``mma.sync`` (Pallas' Triton lowering cannot ask Triton for FP8 MMAv3), so the FP8 tensor cores stay idle. This
kernel is written for Mosaic GPU, whose ``wgmma`` takes e4m3/e5m2 operands from shared memory: compiled for
sm_90a its PTX holds ``wgmma.mma_async.sync.aligned.m64n{tile_n}k32.f32.e4m3.e4m3`` (checked in
tests/test_mosaic_gemm.py by a deviceless compile).

Semantics (DeepSeek-V3 / DeepGEMM ``fp8_gemm_nt`` 1D2D, vLLM ``w8a8_block_fp8_matmul``)::

    y[m, n] = sum_kb (xq[m, kb] . wq[n, kb]) * xs[m, kb] * ws[n // 128, kb]

with ``kb`` a 128-wide block of K. Numerics (DeepGEMM's "promotion"): the wgmma partial of each K block
starts from zero in the tensor cores' float32 accumulator (four ``k32`` instructions); it is then multiplied by the
block's combined scale ``xs[m, kb] * ws[n // 128, kb]`` (one float32 product per row and K block) and added into
a float32 accumulator held in registers (``acc + p * s``; the PTX holds one ``fma.rn.f32`` per element). So the
result is the float64 sum of the formula up to the rounding of the in-block sums, the scale products and the
``K / 128`` block additions: float32 rounding in interpret mode (tests/test_mosaic_gemm.py states and checks the
bound); on Hopper the FP8 wgmma keeps fewer accumulator bits within a block (DeepSeek-V3 measured ~14), which is
why the partials are promoted every 128 and never accumulated across blocks on the tensor cores.

Kernel structure (one CTA per output tile ``(64 * compute_wgs) x tile_n``): a warp-specialized pipeline
(``plgpu.emit_pipeline_warp_specialized``): one memory warpgroup streams, per K block, the ``[cta_m, 128]``
activation tile, the ``[tile_n, 128]`` weight tile (K-major, vLLM's ``[out, in]`` layout, which FP8 wgmma
requires: Mosaic GPU refuses transposed 8-bit operands) and the ``[cta_m]`` activation-scale column through TMA
into a ``stages``-deep ring of 128B-swizzled SMEM buffers; ``compute_wgs`` compute warpgroups each own 64 rows:
per K block they issue the wgmma into a fresh zero accumulator (``m64n{tile_n}k32`` instructions), wait for it,
read their 64 activation scales from SMEM and the block's weight scale (one float32 scalar: ``tile_n`` divides
128, so a tile sees one weight-scale row) from GMEM, and promote. The epilogue casts to ``out_dtype``, writes the
tile into swizzled SMEM and stores it with TMA.

Persistent grid (``MosaicGemmConfig.persistent_ctas > 0``, issue 37 item 2; CUTLASS sm90's persistent kernels and
jax's ``hopper_matmul_mgpu`` do the same): ``min(tiles, persistent_ctas)`` CTAs (132: one per SM) each loop over
output tiles (``plgpu.nd_loop``, tile ``i`` to CTA ``i mod CTAs``) in ``plgpu.planar_snake`` order, bands of
``grid_tile_width`` M tiles walking the N tiles (the CTAs in flight share weight tiles and a few activation row
blocks in L2). The ring and output buffers are allocated once; a tile's TMA store is not waited for after it is
issued but before the next tile's epilogue rewrites the buffer, so it overlaps that tile's loads and wgmmas, and
the memory warpgroup fills the ring for the next tile while the compute warpgroups finish the last. Dense products
only; one of the configurations the on-device tuner times (:func:`candidate_configs`, :func:`tuned_config`).

Ragged shapes are **padded** (not masked) in XLA before the kernel: M to a multiple of ``64 * compute_wgs``
(zero rows and zero scales, sliced away afterwards), N to a multiple of ``tile_n`` (zero weight rows, sliced
away), K to a multiple of 128 (zero columns in both operands: vLLM's zero padding of a ragged last K group, so
the padded products add exact zeros). Activation padding is cheap (at most ``cta_m - 1`` rows); a ragged N or K
copies the weight on every call, so store weights pre-padded if their N or K is not a multiple of 128
(real checkpoints' are). The activation scales are passed transposed (``[KB, M]``, DeepGEMM's
"MN-major" scale layout) so that each K block's scale column is one contiguous TMA box.

Scales of B ("1D2D" and "1D1D", DeepGEMM's names). ``w_scales="block"`` (default): ``ws[n // 128, kb]``, one
128x128 block scale per (column block, K block), vLLM's weights; a CTA reads one float32 scalar per K block.
``w_scales="row"``: ``ws[n, kb]``, a 1x128 group scale per (column, K block), what FP8 training's weight gradient
needs (both of its operands are quantized in 1x128 groups along the token dim, DeepSeek-V3 Sec. 3.3); the CTA
streams a ``[tile_n]`` scale row per K block through TMA (from the transposed ``[KB, N]`` scales, like the
activation scales) and promotes with ``p * (xs[m] * ws[n])``.

Grouped variant (:func:`mosaic_grouped_w8a8_matmul`, MoE experts): the same kernel on rows already in the project's
expert tile layout (:func:`fp8rl_jax.models.grouped.tile_layout`: tiles of ``tile_rows`` rows, each of one
expert); each CTA reads its expert from ``tile_group`` and streams that expert's ``[N, K]`` e4m3 weight and scales.

Operand types: ``(e4m3, e4m3)`` (W8A8 inference) and ``(e5m2, e5m2)``. The mixed ``e5m2 x e4m3`` pair of FP8
training's gradient GEMMs is valid PTX (``wgmma...f32.e5m2.e4m3``) but Mosaic GPU's ``wgmma.py`` (jax 0.10.2,
and the jax-ml/jax snapshot read) emits ``.{t}.{t}`` only and raises "WGMMA requires A and B to have the same
element type"; :func:`mosaic_w8a8_matmul` raises ``NotImplementedError`` for it rather than silently converting
(e5m2 -> e4m3 is not exact).

Interpret mode: ``interpret=True`` runs the same kernel in Mosaic GPU's interpreter on the CPU (jax
``InterpretGPUParams``; needs jax >= 0.10). That interpreter (jax 0.10.2) cannot read a wgmma operand through
``transpose_ref``; :func:`_install_interpret_transpose_support` adds that to it (reading the SMEM tile and
transposing it), nothing else.

Self-test: :func:`_selftest_w8a8_gemm` is the ``w8a8_gemm`` kernel family's (:mod:`fp8rl_jax.kernels.registry`): on the
first CUDA use it compiles and runs this kernel on the GPU against the float64 reference, so a Mosaic GPU API
that moved between jax versions, or a wrong result, makes that process use XLA's path with a warning. The Mosaic GPU
modules are imported inside the kernel builder only (never at import of this module), so importing the package
never depends on them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fp8rl_jax.fp8.formats import BLOCK_SIZE

WG_ROWS = 64  # rows per compute warpgroup: Hopper's wgmma M is 64
FP8_OPERAND_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
OUT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# Hopper: 227 KiB of shared memory per block (cudaDevAttrMaxSharedMemoryPerBlockOptin = 232448 B).
HOPPER_SMEM_BYTES = 232448


@dataclasses.dataclass(frozen=True)
class MosaicGemmConfig:
    """Tile configuration of :func:`mosaic_w8a8_matmul` (hashable; a static argument).

    Attributes:
      tile_n: output columns per CTA: 64 or 128 (must divide the 128-wide weight-scale block, so each CTA reads
        one weight scale per K block). 128 for throughput; 64 doubles the CTA count for small M (decode), where
        the GEMM streams the weight and more SMs pull it.
      compute_wgs: compute warpgroups per CTA (1 or 2), each owning 64 rows: CTA tile ``64 * compute_wgs`` rows.
        2 (DeepGEMM's BLOCK_M=128 with two math warpgroups) lets one warpgroup promote while the other's wgmma
        runs; 1 halves the M padding for M <= 64.
      stages: depth of the TMA ring (K blocks in flight). Per stage ``(64 * compute_wgs + tile_n) * 128`` bytes
        of operands plus ``4 * 64 * compute_wgs`` of scales; with the output tile it must fit 227 KiB.
      memory_registers: registers per thread of the memory (TMA) warpgroup; the compute warpgroups get the rest.
      persistent_ctas: 0 (default): one CTA per output tile, grid ``(M / cta_m, N / tile_n)``. ``> 0``: a
        persistent grid of ``min(tiles, persistent_ctas)`` CTAs (132 = one per H100/H200 SM), each looping over
        output tiles (``plgpu.nd_loop``) in :func:`jax.experimental.pallas.mosaic_gpu.planar_snake` order; a
        tile's TMA store of its output then overlaps the next tile's loads and wgmmas (the CTA waits for that store
        only before it rewrites the output buffer), and the ring's fill overlaps the previous tile's epilogue
        (CUTLASS sm90's persistent kernels, jax's ``hopper_matmul_mgpu``). Dense products only.
      grid_tile_width: with ``persistent_ctas``: the width, in M tiles, of the snake's bands: consecutive tiles
        walk ``grid_tile_width`` M tiles of one column of N tiles before the next column, so the CTAs in flight
        share their weight tiles and ``grid_tile_width`` row blocks of the activations in L2 (at K = 12288 the
        whole M = 4096 activation is 48 MiB, near the 50 MiB L2 of an H100).
      blocks_per_step: 128-wide K blocks per pipeline step (ring stage), 1 or 2. With 2 a compute warpgroup issues
        both blocks' wgmmas into two accumulators, then promotes the first while the second runs on the tensor
        cores (``wgmma_accumulator_load(wait_n=1)``), so its own promotion overlaps its own wgmma, not only the other
        warpgroup's (DeepGEMM overlaps the same way); a stage holds both blocks (``stages`` counts stages: 2 stages
        of 2 blocks keep 4 blocks in flight) and K is zero-padded to a multiple of 256 (exact zeros). Costs 64 more
        accumulator registers per thread.
    """

    tile_n: int = 128
    compute_wgs: int = 2
    stages: int = 4
    memory_registers: int = 40
    persistent_ctas: int = 0
    grid_tile_width: int = 8
    blocks_per_step: int = 1

    @property
    def cta_m(self) -> int:
        """Rows of A per CTA: :data:`WG_ROWS` (64, one wgmma's M) per compute warpgroup."""
        return WG_ROWS * self.compute_wgs

    def stage_bytes(self, block_size: int = BLOCK_SIZE, w_scales: str = "block") -> int:
        """Shared memory of one ring stage: per K block of the step the operand tiles and the ``[cta_m]`` activation
        scales, and with ``w_scales="row"`` a ``[tile_n]`` float32 weight-scale row."""
        per_block = (self.cta_m + self.tile_n) * block_size + 4 * self.cta_m
        if w_scales == "row":
            per_block += 4 * self.tile_n
        return self.blocks_per_step * per_block

    def smem_bytes(self, out_dtype, block_size: int = BLOCK_SIZE, w_scales: str = "block") -> int:
        """Shared memory of the operand ring, the scale ring and the output tile, in bytes (Mosaic GPU adds
        barriers and alignment: :data:`SMEM_MARGIN_BYTES` covers them): :meth:`stage_bytes` per stage."""
        return self.stages * self.stage_bytes(block_size, w_scales) + self.cta_m * self.tile_n * jnp.dtype(
            out_dtype).itemsize

    def validate(self, out_dtype=jnp.float32, w_scales: str = "block"):
        """Raise ``ValueError`` for an unsupported configuration or one that does not fit Hopper's SMEM."""
        if self.tile_n not in (64, 128):
            raise ValueError(f"MosaicGemmConfig.tile_n must be 64 or 128, got {self.tile_n}")
        if self.compute_wgs not in (1, 2):
            raise ValueError(f"MosaicGemmConfig.compute_wgs must be 1 or 2, got {self.compute_wgs}")
        if self.stages < 1:
            raise ValueError(f"MosaicGemmConfig.stages must be >= 1, got {self.stages}")
        if self.persistent_ctas < 0:
            raise ValueError(f"MosaicGemmConfig.persistent_ctas must be >= 0, got {self.persistent_ctas}")
        if self.blocks_per_step not in (1, 2):
            raise ValueError(f"MosaicGemmConfig.blocks_per_step must be 1 or 2, got {self.blocks_per_step}")
        if self.grid_tile_width < 1:
            raise ValueError(f"MosaicGemmConfig.grid_tile_width must be >= 1, got {self.grid_tile_width}")
        need = self.smem_bytes(out_dtype, w_scales=w_scales) + SMEM_MARGIN_BYTES
        if need > HOPPER_SMEM_BYTES:
            raise ValueError(f"MosaicGemmConfig {self} needs ~{need} B of shared memory with {jnp.dtype(out_dtype)} "
                             f"output; Hopper allows {HOPPER_SMEM_BYTES} B per block: lower stages")


# Barriers and alignment on top of smem_bytes (measured: 592 B for the 128x128, 5-stage float32 config, which Mosaic
# GPU refused at 232528 B > 232448 B).
SMEM_MARGIN_BYTES = 1024


def fitted_config(tile_n: int = 128, compute_wgs: int = 2, out_dtype=jnp.float32, max_stages: int = 8,
                  memory_registers: int = 40, w_scales: str = "block", blocks_per_step: int = 1) -> MosaicGemmConfig:
    """The configuration with the deepest TMA ring (at most ``max_stages``) that fits Hopper's shared memory.

    128x128 tiles: 4 stages with float32 output, 5 with bfloat16 (a 5-stage float32 ring needs 232528 B > 232448 B:
    refused by Mosaic GPU); the same with ``w_scales="row"`` (512 B more per stage). 64x64 tiles: ``max_stages``.
    With ``blocks_per_step=2`` a stage holds two K blocks (half as many stages fit).
    """
    cfg = MosaicGemmConfig(tile_n=tile_n, compute_wgs=compute_wgs, stages=1, memory_registers=memory_registers,
                           blocks_per_step=blocks_per_step)
    fit = ((HOPPER_SMEM_BYTES - SMEM_MARGIN_BYTES - cfg.cta_m * tile_n * jnp.dtype(out_dtype).itemsize)
           // cfg.stage_bytes(w_scales=w_scales))
    return dataclasses.replace(cfg, stages=int(max(1, min(max_stages, fit))))


#: M at and above which :func:`default_config` uses 128-row CTAs (two compute warpgroups)
FULL_TILE_ROWS = 2 * WG_ROWS


#: SMs of an H100 SXM: a grid of fewer CTAs leaves SMs idle
H100_SMS = 132


def default_config(m: int, out_dtype=jnp.float32, w_scales: str = "block", n: int | None = None) -> MosaicGemmConfig:
    """Tile configuration by M (and N when given); the deepest TMA ring that fits (:func:`fitted_config`).

    * ``M >= 128``: 128 x 128 CTA tiles, two compute warpgroups (DeepGEMM's BLOCK_M = 128, one warpgroup promotes
      while the other's wgmma runs): the throughput configuration for prefill and training;
    * ``M < 128`` (decode-sized, and the ``64 < M < 128`` band): 64 x 64 tiles, one compute warpgroup. Such a GEMM
      streams the weight (``2 M`` FLOP per weight byte, under H100's ~590 FLOP/B ridge), so what counts is how many
      SMs pull it: 128 x 128 tiles would give ``N / 128`` CTAs (32 of 132 SMs at N = 4096), 64 x 64 tiles give
      ``ceil(M / 64) * N / 64`` (128 at N = 4096, M = 65..127), each weight tile being read by at most two
      neighbouring CTAs (the second read from L2). The M padding is at most 63 rows either way;
    * with ``n`` given, also for ``M >= 128`` when the 128 x 128 grid would occupy fewer than half of the H100's SMs
      (:data:`H100_SMS`): e.g. the engine's decode step at batch 128 (M = 128, N = 4096: 32 CTAs for 132 SMs), where
      the GEMM still streams the weight; 64 x 64 tiles give 4x the CTAs. DeepGEMM chooses its block sizes by SM
      occupancy in the same spirit.

    Chosen by shared-memory fit, SM count and DeepGEMM's layout, not by measurement (no GPU was available):
    tune on the device."""
    small = m < FULL_TILE_ROWS
    if n is not None and not small:
        small = 2 * (-(-m // FULL_TILE_ROWS) * -(-n // 128)) < H100_SMS
    if small:
        return fitted_config(tile_n=64, compute_wgs=1, out_dtype=out_dtype, w_scales=w_scales)
    return fitted_config(tile_n=128, compute_wgs=2, out_dtype=out_dtype, w_scales=w_scales)


#: CTAs of the persistent candidates without a device to ask: one per SM of an H100 SXM / H200
PERSISTENT_CTAS = H100_SMS
#: the most rows a tuning run times on (larger M buckets share the choice made at this M: such a GEMM is many waves
#: of tiles either way, and its operands at M = 65536 would be gigabytes beside the engine's own)
MAX_TUNE_ROWS = 8192


def candidate_configs(m: int, n: int, out_dtype=jnp.float32, w_scales: str = "block",
                      sms: int = PERSISTENT_CTAS) -> list[MosaicGemmConfig]:
    """The configurations the on-device tuner times for a dense product of ``M`` rows and ``N`` columns (issue 37
    items 2 and 3), :func:`default_config`'s first (the reference and the fallback): the 128 x 128 tiles (two
    compute warpgroups) and the 64 x 64 tiles (one) on their deepest ring, and the 128 x 128 tiles on the
    persistent grid (``sms`` CTAs, one per SM, :attr:`MosaicGemmConfig.persistent_ctas`) in snake bands of 8
    and 16 M tiles, and on the persistent grid with two K blocks per step (:attr:`MosaicGemmConfig.blocks_per_step`). Only valid, distinct configurations. Chosen without a GPU from the prefill GEMM's design space
    (tile, persistence, rasterization: the choices CUTLASS sm90 and DeepGEMM make per shape); which wins is the
    device's to say."""
    base = default_config(m, out_dtype, w_scales, n=n)
    big = fitted_config(tile_n=128, compute_wgs=2, out_dtype=out_dtype, w_scales=w_scales)
    small = fitted_config(tile_n=64, compute_wgs=1, out_dtype=out_dtype, w_scales=w_scales)
    out = []
    pair = fitted_config(tile_n=128, compute_wgs=2, out_dtype=out_dtype, w_scales=w_scales, blocks_per_step=2)
    for cfg in (base, big, small, dataclasses.replace(big, persistent_ctas=sms, grid_tile_width=8),
                dataclasses.replace(big, persistent_ctas=sms, grid_tile_width=16),
                dataclasses.replace(pair, persistent_ctas=sms, grid_tile_width=8)):
        if cfg not in out:
            cfg.validate(out_dtype, w_scales)
            out.append(cfg)
    return out


def config_name(cfg: MosaicGemmConfig) -> str:
    """The tuner's name of a configuration, e.g. ``wgmma(128x128,stages=5,persistent=132,width=8)``."""
    name = f"wgmma({cfg.cta_m}x{cfg.tile_n},stages={cfg.stages}"
    if cfg.memory_registers != 40:
        name += f",memory_registers={cfg.memory_registers}"
    if cfg.blocks_per_step != 1:
        name += f",blocks={cfg.blocks_per_step}"
    if cfg.persistent_ctas:
        name += f",persistent={cfg.persistent_ctas},width={cfg.grid_tile_width}"
    return name + ")"


#: the name of XLA's own path among a tuner's candidates (:func:`xla_w8a8_product`)
XLA_CANDIDATE = "xla"


@functools.partial(jax.jit, static_argnames=("out_dtype", "w_scales"))
def xla_w8a8_product(xq, xs, wq, ws, *, out_dtype=jnp.float32, w_scales: str = "block"):
    """XLA's own path for a W8A8 blockwise product, the tuners' ``"xla"`` candidate: both operands dequantized to
    float32 (``xq * xs`` per 1x128 group, ``wq * ws`` per 128x128 block, or per row group with ``w_scales="row"``)
    and one float32 ``dot_general`` (the portable path of :func:`fp8rl_jax.fp8.linear.w8a8_block_matmul`,
    ``dot_general.scaled_matmul(impl="dequant")``) at ``Precision.HIGHEST``: XLA:GPU's default would round the
    operands to TF32 (~5e-4 relative), where the kernels' products are exact and promoted in float32, so the
    candidate meets the tuner's 1e-3 check by the same numerics, not by luck. Where it wins (a memory-bound decode
    shape, the dequantization fused into XLA's GEMM) its speed is XLA's.

    Args: ``xq [M, K]``, ``xs [M, ceil(K/128)]``, ``wq [N, K]``, ``ws [ceil(N/128) or N, ceil(K/128)]`` float32.
    Returns: ``[M, N]`` in ``out_dtype``.
    """
    n, k = wq.shape
    xd = xq.astype(jnp.float32) * jnp.repeat(xs.astype(jnp.float32), BLOCK_SIZE, axis=1)[:, :k]
    rows = ws if w_scales == "row" else jnp.repeat(ws, BLOCK_SIZE, axis=0)[:n]
    wd = wq.astype(jnp.float32) * jnp.repeat(rows.astype(jnp.float32), BLOCK_SIZE, axis=1)[:, :k]
    return jnp.dot(xd, wd.T, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32).astype(out_dtype)


def tuned_config(m: int, n: int, k: int, out_dtype=jnp.float32, w_scales: str = "block",
                 op_dtype=jnp.float8_e4m3fn) -> MosaicGemmConfig | None:
    """The configuration of a dense :func:`mosaic_w8a8_matmul` in this process: on a CUDA device, the fastest of
    :func:`candidate_configs` (persistent grids of one CTA per SM of that device) as timed by
    :func:`fp8rl_jax.kernels.tuner.select` (op ``"w8a8_gemm"``, key ``N``, ``K``, the M bucket
    :func:`fp8rl_jax.kernels.tuner.m_bucket` up to :data:`MAX_TUNE_ROWS` (``"M>"`` beyond), the operand and output
    dtypes and ``w_scales``; timed on operands of the bucket's rows; each candidate's output must match the
    default's to 1e-3 relative (Frobenius): configurations differ only in float32 rounding order, so a tile lost
    or stored from the wrong buffer excludes it; ``FP8RL_AUTOTUNE`` / ``train.autotune`` decide whether it times,
    reads the shipped and cached tables, or keeps the default); elsewhere (no GPU, a deviceless compile)
    :func:`default_config`'s. XLA's own path (:func:`xla_w8a8_product`) is timed beside the configurations (issue
    37 item 3): None when it measured fastest, and :func:`mosaic_w8a8_matmul` then computes the product that way.
    """
    from fp8rl_jax.kernels import registry, tuner

    out_dtype, op_dtype = jnp.dtype(out_dtype), jnp.dtype(op_dtype)
    dev = registry.cuda_device()
    sms = int(getattr(dev, "core_count", 0) or PERSISTENT_CTAS) if dev is not None else PERSISTENT_CTAS
    cands = candidate_configs(m, n, out_dtype, w_scales, sms=sms)
    if m > MAX_TUNE_ROWS:
        rows, bucket = MAX_TUNE_ROWS, {"M>": MAX_TUNE_ROWS}
    else:
        rows = tuner.m_bucket(m)
        bucket = {"M<=": rows}

    def make_args():
        rng = np.random.default_rng(0)
        kb = -(-k // BLOCK_SIZE)
        ws_rows = n if w_scales == "row" else -(-n // BLOCK_SIZE)
        return (jnp.asarray(rng.standard_normal((rows, k)), op_dtype),
                jnp.asarray(rng.uniform(0.5, 2, (rows, kb)), jnp.float32),
                jnp.asarray(rng.standard_normal((n, k)), op_dtype),
                jnp.asarray(rng.uniform(0.5, 2, (ws_rows, kb)), jnp.float32))

    def runner(cfg):
        return lambda xq, xs, wq, ws: mosaic_w8a8_matmul(xq, xs, wq, ws, out_dtype=out_dtype, config=cfg,
                                                         w_scales=w_scales)

    xla = tuner.Candidate(XLA_CANDIDATE, None, functools.partial(xla_w8a8_product, out_dtype=out_dtype,
                                                                 w_scales=w_scales))
    chosen = tuner.select("w8a8_gemm", {"N": n, "K": k, **bucket, "dtype": op_dtype.name, "out": out_dtype.name,
                                        "w_scales": w_scales},
                          [tuner.Candidate(config_name(c), c, runner(c), family="w8a8_gemm") for c in cands] + [xla],
                          make_args, tolerance=1e-3)
    return chosen.config


# ----------------------------------------------------------------------------------------------------------
# Interpret mode support.

_INTERPRET_PATCHED = False


def _install_interpret_transpose_support():
    """Let jax's Mosaic GPU interpreter run ``wgmma`` on a ``transpose_ref``'d SMEM operand.

    jax 0.10.2's interpreter (``jax._src.pallas.mosaic_gpu.interpret.gpu_callbacks.wgmma``) turns the operand
    transforms into index ranges and fails on a ``TransposeTransform`` ("'TransposeTransform' object has no
    attribute 'indices'"). The replacement reads the operand through its index transforms and applies the
    trailing transposes with numpy; calls without a transpose go to the original unchanged. Idempotent; only
    affects interpret mode.
    """
    global _INTERPRET_PATCHED
    if _INTERPRET_PATCHED:
        return
    try:  # jax-private modules: another jax may have moved them (or support transposed operands itself)
        from jax._src.pallas.mosaic.interpret import utils as iu
        from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks as gc
        from jax._src.state import types as state_types

        original = gc.wgmma
        gc._remove_noop_transforms, gc._get_shared_memory, gc.HostAllocationKey  # noqa: B018 - all needed below
    except (ImportError, AttributeError):
        _INTERPRET_PATCHED = True  # leave this jax's interpreter as it is; an unsupported transpose fails there
        return

    def split(transforms):
        index, perms = [], []
        for t in gc._remove_noop_transforms(transforms):
            if isinstance(t, state_types.TransposeTransform):
                perms.append(tuple(int(p) for p in t.permutation))
            elif perms:
                raise NotImplementedError("interpret mode: indexing a wgmma operand after transpose_ref")
            else:
                index.append(t)
        return tuple(index), perms

    def wgmma(*, token, device_id, grid_point_coords, thread_id, acc_allocation_key_as_array, acc_transforms,
              acc_dtype, a_allocation_key_as_array, a_transforms, b_allocation_key_as_array, b_transforms,
              source_info=None):
        a_index, a_perms = split(a_transforms)
        b_index, b_perms = split(b_transforms)
        if not a_perms and not b_perms:
            return original(token=token, device_id=device_id, grid_point_coords=grid_point_coords,
                            thread_id=thread_id, acc_allocation_key_as_array=acc_allocation_key_as_array,
                            acc_transforms=acc_transforms, acc_dtype=acc_dtype,
                            a_allocation_key_as_array=a_allocation_key_as_array, a_transforms=a_transforms,
                            b_allocation_key_as_array=b_allocation_key_as_array, b_transforms=b_transforms,
                            source_info=source_info)
        device_id, thread_id = int(device_id), int(thread_id)
        coords = tuple(int(c) for c in grid_point_coords)
        sm = gc._get_shared_memory()
        gtid = sm.get_global_thread_id(device_id, thread_id)
        info = iu.GPULoggingInfo(device_id=device_id, grid_point_coords=coords, thread_id=thread_id,
                                 source_info=source_info)

        def read(key, index, perms):
            v, _, _ = sm.get_buffer_content(gc.HostAllocationKey.from_array(key),
                                            iu.to_range(jax.tree.map(int, index)), gtid, logging_info=info)
            v = np.asarray(v)
            for p in perms:
                v = np.transpose(v, p)
            return v

        a = read(a_allocation_key_as_array, a_index, a_perms)
        b = read(b_allocation_key_as_array, b_index, b_perms)
        acc_key = gc.HostAllocationKey.from_array(acc_allocation_key_as_array)
        acc_range = iu.to_range(jax.tree.map(int, gc._remove_noop_transforms(acc_transforms)))
        acc, _, _ = sm.get_buffer_content(acc_key, acc_range, gtid, logging_info=info)
        sm.store_buffer_content(acc_key, acc_range, acc + np.matmul(a, b, dtype=acc_dtype), gtid,
                                logging_info=info)
        return token

    gc.wgmma = wgmma
    _INTERPRET_PATCHED = True


def _interpret_params(interpret):
    """``False`` -> compile with Mosaic GPU; ``True`` or an ``InterpretGPUParams`` -> the GPU interpreter."""
    if interpret is False or interpret is None:
        return None
    try:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    except ImportError as e:
        raise NotImplementedError(f"Mosaic GPU interpret mode is not available in jax {jax.__version__} "
                                  f"({e}); it was written against jax 0.10's interpreter") from None

    _install_interpret_transpose_support()
    if interpret is True:
        return InterpretGPUParams()
    if isinstance(interpret, InterpretGPUParams):
        return interpret
    raise ValueError(f"interpret must be a bool or an InterpretGPUParams, got {interpret!r}")


# ----------------------------------------------------------------------------------------------------------
# The kernel.


def _swizzled(plgpu, cols: int, dtype) -> tuple:
    """TMA/wgmma-friendly SMEM transforms for a tile whose rows hold ``cols`` elements of ``dtype``."""
    bits = jnp.dtype(dtype).itemsize * 8
    swizzle = plgpu.find_swizzle(cols * bits)
    return (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))


def _build(mp: int, np_: int, kb: int, bk: int, op_dtype, out_dtype, cfg: MosaicGemmConfig, interpret,
           tile_rows: int | None = None, w_scales: str = "block"):
    """The ``plgpu.kernel`` for padded shapes.

    Dense (``tile_rows=None``): ``(xq [mp, kb*bk], xsT [kb, mp] f32, wq [np_, kb*bk], ws -> [mp, np_] out_dtype``
    with ``ws`` the block scales ``[NB, kb]`` (``w_scales="block"``) or the transposed row scales ``[kb, np_]``
    (``"row"``). Grouped: ``(xq, xsT, wq [E, np_, kb*bk], ws [E, NB, kb] or [E, kb, np_], tile_group int32 [G])``,
    the CTA of rows ``[i * cta_m, (i + 1) * cta_m)`` using expert ``tile_group[i * cta_m // tile_rows]``.
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    tn, nwg, cta_m, bps = cfg.tile_n, cfg.compute_wgs, cfg.cta_m, cfg.blocks_per_step
    if kb % bps:
        raise ValueError(f"_build: {kb} K blocks do not divide into steps of {bps}")
    tiles_per_scale = BLOCK_SIZE // tn
    op_tr = _swizzled(plgpu, bk, op_dtype)
    out_tr = _swizzled(plgpu, tn, out_dtype)
    row_mode = w_scales == "row"

    if interpret is None:
        as_layout = plgpu.layout_cast

        def row_scales(xs_s, wg, j=0):  # [64] activation scales of this warpgroup's rows (K block j of the step)
            return plgpu.load(xs_s.at[j, pl.ds(wg * WG_ROWS, WG_ROWS)], (), layout=plgpu.Layout.WGMMA.reduce(1))

        def col_scales(ws_s, j=0):  # [tn] weight row scales, one per accumulator column
            return plgpu.load(ws_s.at[j], (), layout=plgpu.Layout.WGMMA.reduce(0))

        def acc_load(p_ref, wait_n):  # the wgmma result once at most wait_n wgmma groups are still in flight
            return plgpu.wgmma_accumulator_load(p_ref, wait_n=wait_n)
    else:  # the interpreter has no layouts (and no plgpu.load)
        def as_layout(x, layout):
            del layout
            return x

        def row_scales(xs_s, wg, j=0):
            return lax.dynamic_slice_in_dim(xs_s[j, :], wg * WG_ROWS, WG_ROWS)

        def col_scales(ws_s, j=0):
            return ws_s[j, :]

        def acc_load(p_ref, wait_n):  # the interpreter's wgmma is synchronous
            del wait_n
            return p_ref[...]

    def make_step(ws_ref, nb, wg):
        def step(idx, x_s, w_s, xs_s, *scale_and_acc):
            (k,) = idx
            *ws_s, acc = scale_and_acc
            # each K block's row scales (and its weight-block scale, from global memory: an L2 round trip) are read
            # before its wgmma is issued, so that their loads overlap the tensor cores' work instead of following
            # wgmma_wait. Row mode's [tn] weight scales (shared memory, a short wait) are read where used: with
            # two blocks, two of them live beside three accumulators spilled (sm_90a, 392 B); so are the broadcasts
            rows = [row_scales(xs_s, wg, j) if row_mode else row_scales(xs_s, wg, j) * ws_ref[nb, k * bps + j]
                    for j in range(bps)]

            def scaled(p, j):  # p * s with s = xs[m] * ws (block) or xs[m] * ws[n] (row), as the formula rounds
                s = lax.broadcast_in_dim(rows[j], (WG_ROWS, tn), (0,))
                if row_mode:  # 1D1D: s[m, n] = xs[m] * ws[n]
                    s = s * lax.broadcast_in_dim(col_scales(ws_s[0], j), (WG_ROWS, tn), (1,))
                return p * s

            def mma(*p_refs):  # one fresh accumulator per K block: each block's partial is promoted alone
                for j, p_ref in enumerate(p_refs):
                    cols = pl.ds(j * bk, bk)
                    plgpu.wgmma(p_ref, x_s.at[pl.ds(wg * WG_ROWS, WG_ROWS), cols],
                                plgpu.transpose_ref(w_s.at[:, cols], (1, 0)))
                out = acc
                for j, p_ref in enumerate(p_refs):  # block j's product while the later blocks' wgmmas run
                    out = out + scaled(acc_load(p_ref, bps - 1 - j), j)
                return out

            return pl.run_scoped(mma, *[plgpu.ACC((WG_ROWS, tn), jnp.float32) for _ in range(bps)])

        return step

    def pipeline(step, mi, ni, epilogue):
        """The warp-specialized K loop of the output tile ``(mi, ni)``."""
        in_specs = [
            plgpu.BlockSpec((cta_m, bps * bk), lambda k: (mi, k), transforms=op_tr),
            plgpu.BlockSpec((tn, bps * bk), lambda k: (ni, k), transforms=op_tr),
            plgpu.BlockSpec((bps, cta_m), lambda k: (k, mi)),
        ]
        if row_mode:  # the K block's [tn] weight scales stream through TMA beside the activation scales
            in_specs.append(plgpu.BlockSpec((bps, tn), lambda k: (k, ni)))
        return plgpu.emit_pipeline_warp_specialized(
            step,
            grid=(kb // bps,),
            memory_registers=cfg.memory_registers,
            in_specs=in_specs,
            wg_axis="wg",
            num_compute_wgs=nwg,
            max_concurrent_steps=cfg.stages,
            compute_context=epilogue,
        )

    def operands(x_g, w_ref, xs_g, ws_ref):
        return [x_g, w_ref, xs_g] + ([ws_ref] if row_mode else [])

    def store(o_s, o_g, acc, mi, ni, wg):
        o_s[wg] = acc.astype(out_dtype)
        plgpu.commit_smem()
        rows = pl.ds(mi * cta_m + wg * WG_ROWS, WG_ROWS)
        plgpu.copy_smem_to_gmem(o_s.at[wg], o_g.at[rows, pl.ds(ni * tn, tn)])

    def zeros():
        return as_layout(jnp.zeros((WG_ROWS, tn), jnp.float32), plgpu.Layout.WGMMA)

    out_smem = plgpu.SMEM((nwg, WG_ROWS, tn), out_dtype, transforms=out_tr)

    def body(x_g, xs_g, w_g, ws_g, *rest):
        *tg, o_g = rest
        mi, ni, wg = lax.axis_index("m"), lax.axis_index("n"), lax.axis_index("wg")
        if tile_rows is None:
            w_ref, ws_ref = w_g, ws_g
        else:  # the expert of this CTA's rows
            e = tg[0][(mi * cta_m) // tile_rows]
            w_ref, ws_ref = w_g.at[e], ws_g.at[e]

        @functools.partial(pl.run_scoped, o_s=out_smem, collective_axes="wg")
        def _scope(o_s):
            def epilogue(run):
                store(o_s, o_g, run(zeros()), mi, ni, wg)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

            step = make_step(ws_ref, ni // tiles_per_scale, wg)
            pipeline(step, mi, ni, epilogue)(*operands(x_g, w_ref, xs_g, ws_ref))

    n_m, n_n = mp // cta_m, np_ // tn
    ctas = min(n_m * n_n, cfg.persistent_ctas)

    def persistent_body(x_g, xs_g, w_g, ws_g, o_g):
        wg = lax.axis_index("wg")
        ops = operands(x_g, w_g, xs_g, ws_g)
        ignore = lambda *_, **__: None  # noqa: E731 - bodies do not change the pipeline's buffers
        allocs = pipeline(ignore, 0, 0, ignore).get_allocations(*ops)

        @functools.partial(pl.run_scoped, allocs=allocs, o_s=out_smem, collective_axes="wg")
        def _scope(allocs, o_s):
            @plgpu.nd_loop((n_m * n_n,), collective_axes="sm")
            def _tile(info):
                (lin,) = info.index
                mi, ni = plgpu.planar_snake(lin, (n_m, n_n), 0, cfg.grid_tile_width)

                def epilogue(run):
                    acc = run(zeros())
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's store has read o_s[wg]
                    store(o_s, o_g, acc, mi, ni, wg)

                step = make_step(ws_g, ni // tiles_per_scale, wg)
                pipeline(step, mi, ni, epilogue)(*ops, allocations=allocs)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    name = "fp8_blockwise_gemm_wgmma" if tile_rows is None else "fp8_blockwise_grouped_gemm_wgmma"
    if ctas:
        if tile_rows is not None:
            raise ValueError("MosaicGemmConfig.persistent_ctas: the persistent grid is for dense products only")
        kernel_body, grid, grid_names, name = persistent_body, (ctas,), ("sm",), name + "_persistent"
    else:
        kernel_body, grid, grid_names = body, (n_m, n_n), ("m", "n")
    return plgpu.kernel(
        kernel_body,
        out_type=jax.ShapeDtypeStruct((mp, np_), out_dtype),
        grid=grid,
        grid_names=grid_names,
        num_threads=nwg + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret if interpret is not None else False,
        kernel_name=name + ("_1d1d" if row_mode else ""),
    )


def _pad_to(a, shape):
    pads = [(0, t - s) for s, t in zip(a.shape, shape)]
    return jnp.pad(a, pads) if any(p for _, p in pads) else a


def _steps_of(kb: int, cfg: MosaicGemmConfig) -> int:
    """``kb`` K blocks rounded up to whole pipeline steps of ``cfg.blocks_per_step`` blocks."""
    return -(-kb // cfg.blocks_per_step) * cfg.blocks_per_step


def _kernel_w_scales(ws, np_: int, w_scales: str, kb: int):
    """The weight scales as the kernel reads them: block scales ``[..., NB, KB]`` zero-padded to ``kb`` K blocks;
    row scales ``[..., N, KB]`` padded to ``np_`` rows and ``kb`` blocks and transposed to ``[..., kb, np_]`` (each K
    block's scale row one contiguous TMA box)."""
    if w_scales == "block":
        return _pad_to(ws, ws.shape[:-1] + (kb,))
    ws = _pad_to(ws, ws.shape[:-2] + (np_, kb))
    return jnp.swapaxes(ws, -1, -2)


@functools.partial(jax.jit, static_argnames=("out_dtype", "cfg", "interpret", "w_scales"))
def _dense(xq, xs, wq, ws, *, out_dtype, cfg, interpret, w_scales):
    m, k = xq.shape
    n = wq.shape[0]
    kb = _steps_of(xs.shape[1], cfg)  # zero K blocks up to whole steps
    kp = kb * BLOCK_SIZE
    mp = -(-m // cfg.cta_m) * cfg.cta_m
    np_ = -(-n // cfg.tile_n) * cfg.tile_n
    xq = _pad_to(xq, (mp, kp))
    wq = _pad_to(wq, (np_, kp))
    xs_t = _pad_to(xs.T, (kb, mp))
    call = _build(mp, np_, kb, BLOCK_SIZE, xq.dtype, out_dtype, cfg, _interpret_params(interpret),
                  w_scales=w_scales)
    y = call(xq, xs_t, wq, _kernel_w_scales(ws, np_, w_scales, kb))
    return y[:m, :n] if (mp, np_) != (m, n) else y


def _check_out_dtype(out_dtype, name):
    out_dtype = jnp.dtype(out_dtype)
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"{name}: out_dtype must be one of {[str(d) for d in OUT_DTYPES]}, got {out_dtype}")
    return out_dtype


#: values of the ``w_scales`` argument: 128x128 weight blocks (1D2D) or 1x128 row groups of B (1D1D)
W_SCALES = ("block", "row")


def check_operands(xq, xs, wq, ws, block_size: int, name: str = "mosaic_w8a8_matmul", w_scales: str = "block"):
    """Validate W8A8 blockwise operands; returns ``(M, N, K, KB)``.

    Raises:
      ValueError: non-2-D operands, K mismatch, scale shapes other than ``xs [M, ceil(K/bs)]`` and
        ``ws [ceil(N/bs), ceil(K/bs)]`` (``w_scales="block"``) or ``ws [N, ceil(K/bs)]`` (``"row"``), an unknown
        ``w_scales``, non-FP8 operands, non-float scales, ``block_size != 128``.
      NotImplementedError: operands of two different FP8 formats (see the module docstring).
    """
    if w_scales not in W_SCALES:
        raise ValueError(f"{name}: w_scales must be one of {W_SCALES}, got {w_scales!r}")
    if block_size != BLOCK_SIZE:
        raise ValueError(f"{name}: block_size must be {BLOCK_SIZE} (one wgmma K group per 128B-swizzled row), "
                         f"got {block_size}")
    for what, a in (("xq", xq), ("wq", wq), ("xs", xs), ("ws", ws)):
        if a.ndim != 2:
            raise ValueError(f"{name}: {what} must be 2-D, got shape {tuple(a.shape)}")
    for what, a in (("xq", xq), ("wq", wq)):
        if jnp.dtype(a.dtype) not in FP8_OPERAND_DTYPES:
            raise ValueError(f"{name}: {what} must be float8_e4m3fn or float8_e5m2, got {a.dtype}")
    for what, a in (("xs", xs), ("ws", ws)):
        if not jnp.issubdtype(a.dtype, jnp.floating) or jnp.dtype(a.dtype) in FP8_OPERAND_DTYPES:
            raise ValueError(f"{name}: scale {what} must be float32 (or another wide float), got {a.dtype}")
    if jnp.dtype(xq.dtype) != jnp.dtype(wq.dtype):
        raise NotImplementedError(
            f"{name}: mixed FP8 operands ({xq.dtype} x {wq.dtype}) are valid PTX but Mosaic GPU's wgmma only "
            "emits one element type for A and B ('WGMMA requires A and B to have the same element type'); "
            "use the XLA / Triton paths for mixed-format gradient GEMMs")
    m, k = xq.shape
    n, k2 = wq.shape
    if k != k2:
        raise ValueError(f"{name}: K mismatch: xq is {tuple(xq.shape)} ([M, K]) but wq is {tuple(wq.shape)} "
                         "([N, K], vLLM's [out, in] layout)")
    kb = -(-k // block_size)
    if tuple(xs.shape) != (m, kb):
        raise ValueError(f"{name}: xs must be [M, ceil(K/{block_size})] = {(m, kb)}, got {tuple(xs.shape)}")
    if w_scales == "block" and tuple(ws.shape) != (-(-n // block_size), kb):
        raise ValueError(f"{name}: ws must be [ceil(N/{block_size}), ceil(K/{block_size})] = "
                         f"{(-(-n // block_size), kb)}, got {tuple(ws.shape)}")
    if w_scales == "row" and tuple(ws.shape) != (n, kb):
        raise ValueError(f"{name}: with w_scales='row' ws must be [N, ceil(K/{block_size})] = {(n, kb)}, got "
                         f"{tuple(ws.shape)}")
    return m, n, k, kb


def mosaic_w8a8_matmul(xq: jax.Array, xs: jax.Array, wq: jax.Array, ws: jax.Array, *,
                       block_size: int = BLOCK_SIZE, out_dtype=jnp.float32, interpret=False,
                       config: MosaicGemmConfig | None = None, w_scales: str = "block") -> jax.Array:
    """W8A8 blockwise FP8 GEMM on Hopper FP8 tensor cores (Pallas Mosaic GPU, ``wgmma`` e4m3).

    ``y[m, n] = sum_kb (xq[m, kb] . wq[n, kb]) * xs[m, kb] * ws[n // 128, kb]``: DeepGEMM ``fp8_gemm_nt``
    (1D2D scaling) / vLLM ``w8a8_block_fp8_matmul`` semantics, with DeepGEMM's promotion (each 128-wide K
    block's wgmma partial starts at zero in float32, is scaled by ``xs * ws`` and added to a float32
    accumulator). With ``w_scales="row"``: ``... * xs[m, kb] * ws[n, kb]`` (1D1D, both operands in 1x128 groups
    along K). See the module docstring for the kernel, padding of ragged shapes and numerics.

    Args:
      xq: ``[M, K]`` activations, ``float8_e4m3fn`` (or ``float8_e5m2`` together with an e5m2 ``wq``).
      xs: ``[M, ceil(K/128)]`` activation scales (``scale_inv``: ``x ~= xq * xs`` per 1x128 group); cast to
        float32.
      wq: ``[N, K]`` weights in vLLM's ``[out, in]`` layout (K-major B), same FP8 format as ``xq``.
      ws: ``[ceil(N/128), ceil(K/128)]`` weight block scales (``scale_inv`` of each 128x128 block: ``w ~= wq * ws``),
        or with ``w_scales="row"`` ``[N, ceil(K/128)]`` (one scale per row and 1x128 group); cast to float32.
      block_size: the scale block, 128 (the only supported value).
      out_dtype: ``float32`` (default), ``bfloat16`` or ``float16``; accumulation is float32 either way.
      interpret: ``False`` (default) compiles with Mosaic GPU (needs an sm_90a target: a Hopper GPU, or a
        deviceless compile); ``True`` (or a ``jax._src.pallas.mosaic_gpu.interpret.params.InterpretGPUParams``)
        runs the same kernel in Mosaic GPU's interpreter on the CPU (slow: tests only).
      config: tile configuration (:class:`MosaicGemmConfig`); default :func:`tuned_config` of M, N and K (the
        on-device tuner's choice among :func:`candidate_configs` on a GPU, :func:`default_config`'s elsewhere and
        in interpret mode).
      w_scales: ``"block"`` (default) or ``"row"`` (the layout of ``ws``).

    Returns:
      ``[M, N]`` array of ``out_dtype`` (``M = 0``: an empty array, no kernel).

    Raises:
      ValueError: shape or dtype errors (see :func:`check_operands`), unsupported ``out_dtype``, a config that
        does not fit Hopper's shared memory.
      NotImplementedError: ``xq`` and ``wq`` in different FP8 formats (Mosaic GPU limitation).
    """
    m, n, _, _ = check_operands(xq, xs, wq, ws, block_size, w_scales=w_scales)
    out_dtype = _check_out_dtype(out_dtype, "mosaic_w8a8_matmul")
    if config is not None:
        cfg = config
    elif interpret is False and m:
        cfg = tuned_config(m, n, xq.shape[1], out_dtype, w_scales, xq.dtype)
        if cfg is None:  # XLA's own path measured fastest on this device
            return xla_w8a8_product(xq, xs, wq, ws, out_dtype=out_dtype, w_scales=w_scales)
    else:
        cfg = default_config(m, out_dtype, w_scales, n=n)
    cfg.validate(out_dtype, w_scales)
    if not isinstance(interpret, bool):
        _interpret_params(interpret)  # validates; InterpretGPUParams is hashable (frozen dataclass)
    if m == 0:
        return jnp.zeros((0, n), out_dtype)
    return _dense(xq, xs.astype(jnp.float32), wq, ws.astype(jnp.float32), out_dtype=out_dtype, cfg=cfg,
                  interpret=interpret, w_scales=w_scales)


@functools.partial(jax.jit, static_argnames=("tile_rows", "out_dtype", "cfg", "interpret", "w_scales"))
def _grouped(xq, xs, wq, ws, tile_group, *, tile_rows, out_dtype, cfg, interpret, w_scales):
    t, k = xq.shape
    _, n, _ = wq.shape
    kb = _steps_of(xs.shape[1], cfg)  # zero K blocks up to whole steps
    kp = kb * BLOCK_SIZE
    np_ = -(-n // cfg.tile_n) * cfg.tile_n
    xq = _pad_to(xq, (t, kp))
    wq = _pad_to(wq, (wq.shape[0], np_, kp))
    call = _build(t, np_, kb, BLOCK_SIZE, xq.dtype, out_dtype, cfg, _interpret_params(interpret),
                  tile_rows=tile_rows, w_scales=w_scales)
    y = call(xq, _pad_to(xs.T, (kb, t)), wq, _kernel_w_scales(ws, np_, w_scales, kb), tile_group.astype(jnp.int32))
    return y[:, :n] if np_ != n else y


def grouped_config(tile_rows: int, out_dtype=jnp.float32, w_scales: str = "block") -> MosaicGemmConfig:
    """Default tile configuration of :func:`mosaic_grouped_w8a8_matmul`: 128 x 128 CTA tiles (two compute
    warpgroups) when ``tile_rows`` is a multiple of 128, else 64 x 128 (one warpgroup); deepest ring that fits.

    Raises:
      ValueError: ``tile_rows`` not a positive multiple of 64 (Hopper's wgmma M).
    """
    if tile_rows <= 0 or tile_rows % WG_ROWS:
        raise ValueError(f"tile_rows must be a positive multiple of {WG_ROWS} (wgmma M), got {tile_rows}")
    return fitted_config(tile_n=128, compute_wgs=2 if tile_rows % (2 * WG_ROWS) == 0 else 1, out_dtype=out_dtype,
                         w_scales=w_scales)


def mosaic_grouped_w8a8_matmul(xq: jax.Array, xs: jax.Array, wq: jax.Array, ws: jax.Array, tile_group: jax.Array,
                               *, tile_rows: int, block_size: int = BLOCK_SIZE, out_dtype=jnp.float32,
                               interpret=False, config: MosaicGemmConfig | None = None,
                               w_scales: str = "block") -> jax.Array:
    """Grouped (MoE) W8A8 blockwise FP8 GEMM on rows in the project's expert tile layout (Mosaic GPU, FP8 wgmma).

    ``y[r, n] = sum_kb (xq[r, kb] . wq[e, n, kb]) * xs[r, kb] * ws[e, n // 128, kb]`` with
    ``e = tile_group[r // tile_rows]``: the rows are already placed in tiles of ``tile_rows`` rows that each hold
    one expert's rows (:func:`fp8rl_jax.models.grouped.tile_layout`: MegaBlocks / megablox padded block layout,
    padding rows zero), so each CTA (``64 * compute_wgs`` rows, dividing ``tile_rows``) multiplies by one expert's
    ``[N, K]`` weight, read directly in e4m3 with its 128x128 scales. Per-row numerics are those of
    :func:`mosaic_w8a8_matmul` against that row's expert (DeepGEMM promotion; vLLM ``fused_moe`` with
    ``block_shape=[128, 128]`` / DeepGEMM ``m_grouped_fp8_gemm_nt_contiguous`` semantics). A batched GEMM
    (``[B, M, K] x [B, N, K]``) is this with ``tile_group = arange(B)`` and each batch's rows padded to
    ``tile_rows``.

    Args:
      xq: ``[T, K]`` FP8 rows in tile layout, ``T = G * tile_rows`` (padding rows: any value, e.g. zeros).
      xs: ``[T, ceil(K/128)]`` activation scales (float32).
      wq: ``[E, N, K]`` expert weights (HF/vLLM ``[out, in]`` per expert), same FP8 format as ``xq``.
      ws: ``[E, ceil(N/128), ceil(K/128)]`` weight block scales (float32), or with ``w_scales="row"``
        ``[E, N, ceil(K/128)]``.
      tile_group: int ``[G]``: the expert of each tile (``TileLayout.tile_group``); values must lie in
        ``[0, E)`` (not checked: a traced array).
      tile_rows: rows per tile (static), a multiple of 64.
      block_size, out_dtype, interpret, w_scales: as :func:`mosaic_w8a8_matmul`.
      config: tile configuration; default :func:`grouped_config`. ``config.cta_m`` must divide ``tile_rows``.

    Returns:
      ``[T, N]`` in ``out_dtype`` (padding rows hold their own products; callers drop them).

    Raises:
      ValueError: shape or dtype errors, ``tile_rows`` not a multiple of 64 or of ``config.cta_m``, ``T`` not
        ``G * tile_rows``.
      NotImplementedError: ``xq`` and ``wq`` in different FP8 formats.
    """
    name = "mosaic_grouped_w8a8_matmul"
    if wq.ndim != 3 or ws.ndim != 3 or tile_group.ndim != 1:
        raise ValueError(f"{name}: wq must be [E, N, K], ws [E, NB, KB] (or [E, N, KB]) and tile_group [G]; got "
                         f"{tuple(wq.shape)}, {tuple(ws.shape)}, {tuple(tile_group.shape)}")
    if wq.shape[0] != ws.shape[0]:
        raise ValueError(f"{name}: wq has {wq.shape[0]} experts but ws {ws.shape[0]}")
    check_operands(xq, xs, wq[0], ws[0], block_size, name, w_scales=w_scales)
    if not jnp.issubdtype(tile_group.dtype, jnp.integer):
        raise ValueError(f"{name}: tile_group must be an integer array, got {tile_group.dtype}")
    cfg = config or grouped_config(tile_rows, out_dtype, w_scales)
    if tile_rows <= 0 or tile_rows % cfg.cta_m:
        raise ValueError(f"{name}: tile_rows={tile_rows} must be a positive multiple of the CTA rows {cfg.cta_m}")
    t = xq.shape[0]
    if t != tile_group.shape[0] * tile_rows:
        raise ValueError(f"{name}: xq has {t} rows but tile_group {tile_group.shape[0]} tiles of {tile_rows}")
    out_dtype = _check_out_dtype(out_dtype, name)
    cfg.validate(out_dtype, w_scales)
    if not isinstance(interpret, bool):
        _interpret_params(interpret)
    if t == 0:
        return jnp.zeros((0, wq.shape[1]), out_dtype)
    return _grouped(xq, xs.astype(jnp.float32), wq, ws.astype(jnp.float32), tile_group, tile_rows=tile_rows,
                    out_dtype=out_dtype, cfg=cfg, interpret=interpret, w_scales=w_scales)


def batched_w8a8_matmul(xq: jax.Array, xs: jax.Array, wq: jax.Array, ws: jax.Array, *, block_size: int = BLOCK_SIZE,
                        out_dtype=jnp.float32, interpret=False, w_scales: str = "block") -> jax.Array:
    """Batched W8A8 blockwise FP8 GEMM ``[B, M, K] x [B, N, K] -> [B, M, N]`` on the Mosaic GPU kernel.

    ``B = 1`` is :func:`mosaic_w8a8_matmul`; ``B > 1`` (FP8 training's products on MoE expert tiles, one weight per
    batch) is :func:`mosaic_grouped_w8a8_matmul` with ``tile_group = arange(B)``, each batch's rows zero-padded to
    ``tile_rows``: M rounded up to the CTA rows of :func:`default_config` of ``(M, B * N)`` (64 or 128; padding rows
    are dropped).

    Args:
      xq: ``[B, M, K]`` FP8; xs: ``[B, M, ceil(K/128)]`` float32.
      wq: ``[B, N, K]`` FP8 (same format as ``xq``); ws: ``[B, ceil(N/128), ceil(K/128)]`` (``w_scales="block"``)
        or ``[B, N, ceil(K/128)]`` (``"row"``).
      block_size, out_dtype, interpret, w_scales: as :func:`mosaic_w8a8_matmul`.

    Returns:
      ``[B, M, N]`` in ``out_dtype``.

    Raises:
      ValueError / NotImplementedError: as :func:`mosaic_w8a8_matmul` (operands not 3-D with one batch size:
        ``ValueError``).
    """
    if xq.ndim != 3 or xs.ndim != 3 or wq.ndim != 3 or ws.ndim != 3 or len({a.shape[0] for a in (xq, xs, wq, ws)}) != 1:
        raise ValueError(f"batched_w8a8_matmul: operands must be [B, ...] 3-D arrays of one batch size, got "
                         f"{[tuple(a.shape) for a in (xq, xs, wq, ws)]}")
    b, m, k = xq.shape
    if b == 1:
        return mosaic_w8a8_matmul(xq[0], xs[0], wq[0], ws[0], block_size=block_size, out_dtype=out_dtype,
                                  interpret=interpret, w_scales=w_scales)[None]
    n = wq.shape[1]
    cfg = default_config(m, out_dtype, w_scales, n=b * n)
    rows = max(cfg.cta_m, -(-m // cfg.cta_m) * cfg.cta_m)
    xq_t = _pad_to(xq, (b, rows, k)).reshape(b * rows, k)
    xs_t = _pad_to(xs, (b, rows, xs.shape[2])).reshape(b * rows, xs.shape[2])
    y = mosaic_grouped_w8a8_matmul(xq_t, xs_t, wq, ws, jnp.arange(b, dtype=jnp.int32), tile_rows=rows,
                                   block_size=block_size, out_dtype=out_dtype, interpret=interpret, config=cfg,
                                   w_scales=w_scales)
    return y.reshape(b, rows, n)[:, :m]


# ----------------------------------------------------------------------------------------------------------
# Self-test of the ``w8a8_gemm`` kernel family (fp8rl_jax.kernels.registry).

#: Self-test tolerance, a fraction of each output's sum of |terms|. On Hopper the FP8 wgmma keeps ~14 bits while it
#: sums a K block's products (DeepSeek-V3 Sec. 3.3.2: the reason for promoting every 128), i.e. errors of order
#: 2**-13 of the block's |terms|; 2**-10 leaves 8x room for that (the float32 rounding of the rest is ~2**-24 per
#: operation). The bugs the self-test is for (a Mosaic GPU API that moved, a wrong scale, tile, expert or layout)
#: miss by far more: a dropped K block by ~1/KB of the output, a misplaced scale by orders of magnitude.
SELFTEST_RTOL = 2.0 ** -10


def _selftest_w8a8_gemm(interpret=False) -> None:
    """Self-test of the ``w8a8_gemm`` family (the Mosaic GPU wgmma GEMM), run once on the GPU on first use.

    Two ragged cases on the default device, each against the float64 product of the same e4m3 operands
    (:func:`fp8rl_jax.kernels.pallas_gemm.w8a8_reference`; operands quantized on the CPU with vLLM's roundings):

    1. dense, M = 130 (>= 128: the 128 x 128, two-warpgroup configuration, two CTA rows), N = 200 (two weight-scale
       rows), K = 300 (three K blocks), padded in every dimension, 128x128 weight blocks (the engine's prefill and
       the FP8 training forward);
    2. grouped, 2 tiles of 64 rows for experts (1, 0), N = 60, K = 300, 64 x 64 CTA tiles, 1x128 row scales of B
       (the MoE tile path, FP8 training's batched products and its weight gradient).

    To :data:`SELFTEST_RTOL` of the sum of |terms|. Kept small: ~10 s in Mosaic GPU's interpreter on a CPU
    (tests), a few compiles of a second on the GPU.

    Raises:
      fp8rl_jax.kernels.registry.KernelMismatch: a result outside the tolerance; the Mosaic GPU compile or lowering
        error unchanged (e.g. an API of another jax version).
    """
    import numpy as np

    from fp8rl_jax.kernels.registry import check_close
    from fp8rl_jax.kernels.pallas_gemm import selftest_operands, w8a8_reference

    _, xq, xs, wq, ws = selftest_operands(130, 200, 300, seed=3)
    y = mosaic_w8a8_matmul(*(jnp.asarray(a) for a in (xq, xs, wq, ws)), interpret=interpret,
                           config=fitted_config(tile_n=128, compute_wgs=2))
    ref, bound = w8a8_reference(xq, xs, wq, ws)
    check_close("Mosaic GPU W8A8 GEMM M=130 N=200 K=300", y, ref, bound, SELFTEST_RTOL)

    tiles = np.array([1, 0], np.int32)
    _, xq, xs, _, _ = selftest_operands(64 * len(tiles), 8, 300, seed=4)
    experts = [selftest_operands(60, 8, 300, seed=5 + e) for e in range(2)]  # 60 rows in 1x128 groups = B
    wq = np.stack([e[1] for e in experts])
    ws = np.stack([e[2] for e in experts])
    cfg = fitted_config(tile_n=64, compute_wgs=1, w_scales="row")
    y = mosaic_grouped_w8a8_matmul(*(jnp.asarray(a) for a in (xq, xs, wq, ws, tiles)), tile_rows=64, config=cfg,
                                   w_scales="row", interpret=interpret)
    ref = np.zeros((xq.shape[0], 60))
    bound = np.zeros_like(ref)
    for i, e in enumerate(tiles):
        rows = slice(64 * i, 64 * (i + 1))
        ref[rows], bound[rows] = w8a8_reference(xq[rows], xs[rows], wq[e], ws[e], w_scales="row")
    check_close("Mosaic GPU grouped W8A8 GEMM 2 tiles x [60, 300], row scales", y, ref, bound, SELFTEST_RTOL)


def _register_selftest() -> None:
    from fp8rl_jax.kernels.registry import register_selftest

    register_selftest("w8a8_gemm", _selftest_w8a8_gemm)


_register_selftest()


#: the Qwen3-8B prefill GEMMs ``(name, N, K)`` (fused q/k/v and gate/up, as the engine runs them)
QWEN3_8B_PREFILL = (("qkv", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up", 24576, 4096), ("down_proj", 4096, 12288))


def main(argv=None) -> None:
    """Time this kernel against bf16 ``dot_general`` at the Qwen3-8B prefill GEMMs (``--m`` rows, default 4096): per
    shape, microseconds and TFLOP/s of bf16 ``x @ w.T``, of this kernel on e4m3 operands (bf16 out), and of the
    activation quantization (:func:`fp8rl_jax.kernels.pallas_quant.pallas_quantize_activation_groupwise`) plus this
    kernel, with the FP8 / bf16 speedups (issue 37 item 2's goal: >= 1.3x with the quantization). The kernel runs
    :func:`tuned_config`'s configuration (column ``config``: ``FP8RL_AUTOTUNE`` decides whether it is timed now, read
    from a table, or the default). On a Hopper GPU; ``--smoke`` runs a tiny shape in Mosaic GPU's interpreter on the
    CPU (the numbers then mean nothing).

    Raises:
      SystemExit: bad flags (argparse).
    """
    import numpy as np

    from fp8rl_jax.kernels.pallas_quant import pallas_quantize_activation_groupwise
    from fp8rl_jax.kernels.timing import main_parser, per_call_us, print_table

    p = main_parser("mosaic_gemm", main.__doc__, iters=20)
    p.add_argument("--m", type=int, default=4096)
    args = p.parse_args(argv)  # --smoke: a 64 x 128 x 128 product
    shapes, m, iters = (QWEN3_8B_PREFILL, args.m, args.iters) if not args.smoke else ((("tiny", 128, 128),), 64, 1)
    rng = np.random.default_rng(0)
    rows = []
    for name, n, k in shapes:
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((n, k)) * 0.05, jnp.bfloat16)
        wq = w.astype(jnp.float8_e4m3fn)
        ws = jnp.full((n // BLOCK_SIZE, k // BLOCK_SIZE), 1.0, jnp.float32)
        xq, xs = pallas_quantize_activation_groupwise(x, interpret=args.smoke, check=False)

        def fp8(a, s, q, t):
            return mosaic_w8a8_matmul(a, s, q, t, out_dtype=jnp.bfloat16, interpret=args.smoke)

        def fp8_quant(a, q, t):
            aq, s = pallas_quantize_activation_groupwise(a, interpret=args.smoke, check=False)
            return mosaic_w8a8_matmul(aq, s, q, t, out_dtype=jnp.bfloat16, interpret=args.smoke)

        cfg = tuned_config(m, n, k, jnp.bfloat16) if not args.smoke else default_config(m, jnp.bfloat16, n=n)
        # None: the tuner measured XLA's own path fastest, and the "fp8" columns time that path
        config = config_name(cfg) if cfg is not None else f"{XLA_CANDIDATE} (tuner: XLA's path fastest)"
        flop = 2.0 * m * n * k
        bf16_us = per_call_us(lambda a, b: jnp.dot(a, b.T, preferred_element_type=jnp.float32).astype(jnp.bfloat16),
                              (x, w), iters)
        fp8_us = per_call_us(fp8, (xq, xs, wq, ws), iters)
        fq_us = per_call_us(fp8_quant, (x, wq, ws), iters)
        rows.append((name, config, m, n, k, bf16_us, flop / bf16_us / 1e6, fp8_us, flop / fp8_us / 1e6, fq_us,
                     bf16_us / fp8_us, bf16_us / fq_us))
    print_table("W8A8 Mosaic GPU GEMM vs bf16 dot_general", ("shape", "config", "M", "N", "K", "bf16 us", "bf16 TF/s", "fp8 us", "fp8 TF/s", "fp8+quant us",
                 "fp8/bf16", "fp8+quant/bf16"), rows)


if __name__ == "__main__":  # pragma: no cover
    main()
