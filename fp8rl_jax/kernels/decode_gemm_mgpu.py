"""Swap-AB split-K W8A8 decode GEMM for Hopper (Pallas Mosaic GPU, FP8 ``wgmma``): M <= 64 tokens (issue 37).

Why: the decode GEMM streams the weight (``2 M`` FLOP per weight byte), so its speed is the HBM read rate. The
Pallas-Triton split-K kernel before it re-quantized the activations in every 128-wide K step (a NaN map, max/min,
a division per element, the e4m3 cast, f16 widening: 0.5-1.0 warp-instructions per weight byte with M padded to 16),
kept at most 2 steps in flight per program and ran f16 ``mma.sync``; on an H200 it reached 3-13% of the 4.8 TB/s
(issue 37's profile). This kernel is designed from the roofline instead:

* **swap-AB** (vLLM's DeepGEMM path at M < 32, TRT-LLM's blockscale GEMM): the weight ``[N, K]`` is wgmma's A
  operand (64 rows per compute warpgroup, K-major in shared memory), the tokens ``[M_pad, K]`` are its B operand
  through ``transpose_ref`` (K-major too, as e4m3 wgmma requires), ``N_wgmma = M_pad``, a multiple of 8 (8..64):
  ``wgmma.mma_async...m64n{M_pad}k32.f32.e4m3.e4m3``. No token padding to 64 or 16: at M = 1 the B tile is 8 rows;
* **activations quantized once per layer, outside the kernel** (1x128 groups, the ``quant`` family's decode
  operand quantizer after the RMSNorm that produces them,
  :func:`fp8rl_jax.kernels.pallas_quant.quantize_activation_for_decode`, which writes the zero-padded tokens and
  the transposed scales this kernel reads, :func:`decode_w8a8_partials_t`: no pad or transpose launch between
  them): the K loop holds no division, no amax, no cast: per K block it issues 4 wgmma instructions,
  reads one weight-scale scalar and an ``[M_pad]`` token-scale row, and promotes (``acc += p * (ws * xs)``:
  ``M_pad / 2`` FMAs per thread);
* **a TMA ring** of ``stages`` K blocks (:func:`choose_config`: 4 to 8, 8 on every Qwen3-8B split-K shape, where
  the split's K blocks allow): per stage ``128 * 64 * compute_wgs`` weight bytes (16 KiB with two warpgroups) +
  ``128 * M_pad`` token bytes + ``4 * M_pad`` scale bytes; a ring never holds more than its split's K blocks, and
  :func:`roofline` counts what it holds against the ~24-48 KiB per SM that Little's law asks for at 3.35-4.8 TB/s
  and ~0.7 us latency;
* **split-K** over a ``(N / (64 * compute_wgs), splits)`` grid (:func:`choose_config` picks ``splits``, a divisor
  of the K-block count, for the best wave efficiency on 132 SMs with the CTAs that fit per SM); each CTA writes its
  float32 partial ``[64 * compute_wgs, M_pad]`` to ``partials[split]``. The reduction over splits (and the SwiGLU
  ``silu(gate) * up`` or the residual add of the caller) runs in one XLA fusion after the kernel, so nothing
  non-linear comes before the sum;
* **stream-K** where split-K by divisors cannot fill the SMs (``DecodeGemmConfig.stream_k_ctas``; Osama et al.,
  "Stream-K", PPoPP 2023; CUTLASS sm90's stream-K scheduler): the ``tiles x K blocks`` units are cut into equal
  contiguous ranges of ``L`` units, one per CTA (one wave), a range crossing at most one tile boundary (``L <= K
  blocks``). A CTA keeps two accumulators, the tile it starts in and the next, and adds each K block's promoted
  product to one of them by a 0/1 factor (no branch in the loop); it writes both. Which ``(CTA, segment)`` partials
  make each tile is static, so :func:`decode_w8a8_partials` gathers them into the same ``[S, N_pad, M_pad]`` layout
  as split-K (``S`` = the most CTAs sharing a tile; absent ones read zeros) and the caller's reduction is unchanged.
  The 0/1 factor is a multiply, not a select: a non-finite product (finite e4m3 operands and float32 scales make
  one only by overflowing float32) would also turn the CTA's other tile into NaN.
  Qwen3-30B-A3B's fused q/k/v (``N = 5120, K = 2048``: 40 tiles x 16 blocks) gets 128 CTAs of 5 blocks: 0.97 wave
  efficiency on 132 SMs, where the best split-K gives 0.81.

Semantics: vLLM's W8A8 blockwise contract, ``y[m, n] = sum_kb (xq[m, kb] . wq[n, kb]) * xs[m, kb] * ws[n // 128,
kb]`` with DeepGEMM's promotion (each K block's wgmma partial starts at zero in float32 and is scaled before it is
added), exactly the numerics of :func:`fp8rl_jax.kernels.mosaic_gemm.mosaic_w8a8_matmul` per K block; the split-K
partial sums add in another order (float32 rounding of ``splits`` terms).

Interpret mode (``interpret=True``) runs the same kernel in Mosaic GPU's interpreter on the CPU (tests).
The tuning configuration is :class:`DecodeGemmConfig`; ``python -m fp8rl_jax.kernels.decode_gemm_mgpu`` times the
Qwen3-8B decode shapes on a GPU (``main``), printing achieved HBM bandwidth per config.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from fp8rl_jax.fp8.formats import BLOCK_SIZE
from fp8rl_jax.kernels.mosaic_gemm import (HOPPER_SMEM_BYTES, SMEM_MARGIN_BYTES, WG_ROWS, _interpret_params, _pad_to,
                                       XLA_CANDIDATE, _swizzled, check_operands, xla_w8a8_product)

#: SMs of an H100 SXM / H200 (both 132)
HOPPER_SMS = 132
#: shared memory per SM on Hopper (228 KiB; a CTA may use at most :data:`HOPPER_SMEM_BYTES` of it)
HOPPER_SMEM_PER_SM = 233472
#: the most tokens this kernel takes (wgmma N <= 256; beyond 64 the prefill GEMM is the better shape)
MAX_TOKENS = 64
#: Little's law at 4.8 TB/s and ~0.7 us of memory latency, per SM: the bytes each SM must have in flight (24 KiB)
MIN_BYTES_IN_FLIGHT_PER_SM = 24576
#: the least share of a wave's CTA slots that must be busy (issue 37 item 4; the kernel's goal is 0.95). Both
#: thresholds are :mod:`fp8rl_jax.kernel_roofline`'s checks of the compiled kernel (tested equal)
MIN_WAVE_EFFICIENCY = 0.9


def padded_tokens(m: int) -> int:
    """Tokens as the kernel sees them: ``m`` rounded up to a multiple of 8 (wgmma N; a 16-byte row cannot be
    swizzled), at least 8.

    Raises:
      ValueError: ``m`` outside ``1..64``.
    """
    if not 1 <= m <= MAX_TOKENS:
        raise ValueError(f"decode GEMM takes 1..{MAX_TOKENS} tokens, got {m}")
    return max(8, -(-m // 8) * 8)


@dataclasses.dataclass(frozen=True)
class DecodeGemmConfig:
    """Tuning configuration of :func:`decode_w8a8_matmul` (hashable; a static argument).

    Attributes:
      compute_wgs: compute warpgroups per CTA (1 or 2), each owning 64 weight rows: ``cta_n = 64 * compute_wgs``
        rows of N per CTA (dividing the 128-row weight-scale block, so a CTA reads one weight scale per K block).
      stages: TMA ring depth (K blocks in flight per CTA).
      splits: split-K factor (must divide the K-block count): the grid is ``(N / cta_n, splits)``.
      memory_registers: registers per thread of the TMA warpgroup.
      stream_k_ctas: 0 (split-K), or stream-K over at most this many CTAs (``splits`` must then be 1): each takes
        ``L = ceil(tiles * K blocks / stream_k_ctas)`` consecutive (tile, K block) units, ``L <= K blocks``.
    """

    compute_wgs: int = 2
    stages: int = 6
    splits: int = 1
    memory_registers: int = 40
    stream_k_ctas: int = 0

    def stream_k_units(self, n_tiles: int, kb: int) -> tuple[int, int]:
        """Stream-K's ``(L, CTAs used)``: units per CTA and ``ceil(n_tiles * kb / L)``."""
        total = n_tiles * kb
        per = -(-total // self.stream_k_ctas)
        return per, -(-total // per)

    @property
    def cta_n(self) -> int:
        """Weight rows per CTA."""
        return WG_ROWS * self.compute_wgs

    def stage_bytes(self, m_pad: int) -> int:
        """Shared memory of one ring stage: the weight tile, the token tile and the token-scale row."""
        return (self.cta_n + m_pad) * BLOCK_SIZE + 4 * m_pad

    def smem_bytes(self, m_pad: int) -> int:
        """Shared memory of a CTA: the ring and the float32 output tile (two for stream-K; Mosaic adds barriers:
        :data:`fp8rl_jax.kernels.mosaic_gemm.SMEM_MARGIN_BYTES`)."""
        out_tiles = 2 if self.stream_k_ctas else 1  # stream-K writes two partial tiles
        return self.stages * self.stage_bytes(m_pad) + out_tiles * self.cta_n * m_pad * 4 + SMEM_MARGIN_BYTES

    def ctas_per_sm(self, m_pad: int) -> int:
        """CTAs resident on one SM: 1. Registers decide it, not shared memory: Mosaic GPU's warp specialization gives
        the compute warpgroups the register file (``setmaxnreg``), and ptxas reports 168 registers x 384 threads
        (two compute warpgroups) or 255 x 256 (one) for this kernel in the deviceless sm_90a compile: 64.5 K and
        65.3 K of the SM's 65,536."""
        del m_pad
        return 1

    def validate(self, m_pad: int, kb: int, n: int | None = None) -> None:
        """Raise ``ValueError`` for an unsupported configuration (named field), one that does not fit Hopper's
        shared memory, ``splits`` not dividing the ``kb`` K blocks, or (stream-K, which needs the ``n`` weight rows)
        a CTA range longer than ``kb`` units or ``splits != 1``."""
        if self.compute_wgs not in (1, 2):
            raise ValueError(f"DecodeGemmConfig.compute_wgs must be 1 or 2, got {self.compute_wgs}")
        if self.stages < 2:
            raise ValueError(f"DecodeGemmConfig.stages must be >= 2, got {self.stages}")
        if self.stream_k_ctas < 0:
            raise ValueError(f"DecodeGemmConfig.stream_k_ctas must be >= 0, got {self.stream_k_ctas}")
        if self.stream_k_ctas and self.splits != 1:
            raise ValueError(f"DecodeGemmConfig.splits={self.splits} with stream_k_ctas={self.stream_k_ctas}: "
                             "stream-K replaces split-K (splits must be 1)")
        if self.stream_k_ctas:
            if n is None:
                raise ValueError("DecodeGemmConfig.validate needs the weight rows n for a stream-K configuration")
            per, _ = self.stream_k_units(-(-n // self.cta_n), kb)
            if per > kb:
                raise ValueError(f"DecodeGemmConfig.stream_k_ctas={self.stream_k_ctas} gives {per} units per CTA, "
                                 f"more than the {kb} K blocks of a tile (a CTA may cross one tile boundary): "
                                 "use more CTAs")
        if self.splits < 1 or kb % self.splits:
            raise ValueError(f"DecodeGemmConfig.splits={self.splits} must divide the {kb} K blocks of 128")
        if self.smem_bytes(m_pad) > HOPPER_SMEM_BYTES:
            raise ValueError(f"DecodeGemmConfig {self} needs {self.smem_bytes(m_pad)} B of shared memory at "
                             f"{m_pad} tokens; Hopper allows {HOPPER_SMEM_BYTES} B per block: lower stages")


@dataclasses.dataclass(frozen=True)
class Roofline:
    """What a configuration does on the clock, by arithmetic (no GPU needed): the quantities issue 37 asks every
    shipped decode configuration to meet.

    Attributes:
      grid: CTAs ``(N / cta_n, splits)``; stream-K: ``(CTAs used, 1)``.
      waves: CTAs per wave = SMs x CTAs per SM; ``wave_efficiency`` = CTAs / (waves needed x CTAs per wave).
      bytes_in_flight_per_sm: the ring's bytes per CTA (``min(stages, K blocks per split)`` stages) x CTAs resident
        per SM (:meth:`DecodeGemmConfig.ctas_per_sm`).
      loop_instructions_per_weight_byte: warp-instructions of one K step per weight byte it streams (by count of
        the loop body: 4 wgmma + the promotion's ``M_pad / 2`` FMAs and ``M_pad / 2`` multiplies per thread,
        scale loads and barrier operations; :func:`loop_instruction_count`).
    """

    grid: tuple[int, int]
    wave_efficiency: float
    bytes_in_flight_per_sm: int
    loop_instructions_per_weight_byte: float


def loop_instruction_count(cfg: DecodeGemmConfig, m_pad: int) -> int:
    """Warp-instructions one CTA issues per K step, by count of the kernel's loop body (an upper estimate; the
    deviceless compile's PTX gives the exact count): per compute warp, 4 ``wgmma`` (k32 each) plus fences, the
    promotion ``acc = acc + p * s`` over its ``16 x M_pad`` accumulator slice (``M_pad / 2`` FMA and ``M_pad / 2``
    multiply per thread), 2 scale loads and ~8 barrier/ring operations; the TMA warp issues ~6 per stage."""
    per_warp = 4 + 2 + m_pad // 2 + m_pad // 2 + 2 + 8
    if cfg.stream_k_ctas:  # the second accumulator (M_pad / 2 more FMAs) and the unit -> (tile, block) arithmetic
        per_warp += m_pad // 2 + 8
    return 4 * cfg.compute_wgs * per_warp + 6


def roofline(cfg: DecodeGemmConfig, n: int, k: int, m: int, sms: int = HOPPER_SMS) -> Roofline:
    """The :class:`Roofline` of ``cfg`` for an ``[m, k] x [n, k]`` decode GEMM on ``sms`` SMs."""
    m_pad = padded_tokens(m)
    kb = -(-k // BLOCK_SIZE)
    per_sm = cfg.ctas_per_sm(m_pad)
    wave = sms * per_sm
    if cfg.stream_k_ctas:  # one range of L units per CTA: the time is L units on every SM of the waves used
        tiles = -(-n // cfg.cta_n)
        kps, ctas = cfg.stream_k_units(tiles, kb)
        grid = (ctas, 1)
        eff = tiles * kb / (math.ceil(ctas / wave) * wave * kps)
    else:
        grid = (-(-n // cfg.cta_n), cfg.splits)
        ctas = grid[0] * grid[1]
        eff = ctas / (math.ceil(ctas / wave) * wave)
        kps = max(1, kb // cfg.splits)
    resident = min(per_sm, math.ceil(ctas / sms))
    in_flight = min(cfg.stages, kps) * cfg.stage_bytes(m_pad) * resident  # a ring never holds more than its split
    per_byte = loop_instruction_count(cfg, m_pad) / (cfg.cta_n * BLOCK_SIZE)
    return Roofline(grid, float(eff), int(in_flight), float(per_byte))


#: decode GEMMs whose default configuration misses issue 37's wave-efficiency check (>= 0.9), with the reason;
#: ``(N, K) -> reason``. Reported by scripts/compile_h100.py as known, not hidden. Empty since stream-K: the
#: Qwen3-30B-A3B fused q/k/v (0.81 with split-K) reaches 0.97.
KNOWN_SHORTFALLS: dict = {}


@functools.lru_cache(maxsize=None)  # pure arithmetic on ints; a 36-layer program asks 4 shapes x 36 times per trace
def choose_config(n: int, k: int, m: int, sms: int = HOPPER_SMS, max_stages: int = 8,
                  stream_k: bool = True) -> DecodeGemmConfig:
    """The default configuration for a decode GEMM, chosen by arithmetic (:func:`roofline`), never by a guess:

    among 2 or 1 compute warpgroups (1 only when N is not a multiple of 128), ``stages`` from 4 to ``max_stages``
    that fit shared memory, and ``splits`` dividing the K blocks with at least ``min(stages, 4)`` K blocks per split
    (so the ring holds at least 4 blocks), take the configuration that first keeps at least
    :data:`MIN_BYTES_IN_FLIGHT_PER_SM` in flight, then has the best wave efficiency on ``sms`` SMs; ties go to more
    bytes in flight (up to 4x the minimum), then fewer splits (less partial-sum traffic). The on-device tuner
    (:mod:`fp8rl_jax.kernels.tuner`) may replace it by measurement.

    Split-K by divisors of the K-block count reaches >= 0.97 wave efficiency on every Qwen3-8B decode GEMM at
    M = 1..64, but not on the Qwen3-30B-A3B fused q/k/v (K = 2048: 16 blocks), where the best is 0.81. Where the
    best split-K misses 0.9 and ``stream_k``, the same search runs over stream-K on one wave of CTAs (``L >= 4``
    units each, ``L <= K blocks``) and takes it if it does better (0.97 there). Split-K stays first elsewhere until a
    GPU run has timed the two (where stream-K is the default, the tuner's candidates include the best split-K).

    Raises:
      ValueError: ``m`` outside 1..64.
    """
    m_pad = padded_tokens(m)
    kb = -(-k // BLOCK_SIZE)

    def rank(cfg):  # enough bytes in flight, then wave efficiency, bytes in flight, fewer splits, wgs, stages
        r = roofline(cfg, n, k, m, sms)
        return (r.bytes_in_flight_per_sm >= MIN_BYTES_IN_FLIGHT_PER_SM, round(r.wave_efficiency, 3),
                min(r.bytes_in_flight_per_sm, 4 * MIN_BYTES_IN_FLIGHT_PER_SM), -cfg.splits, cfg.compute_wgs, cfg.stages)

    best, best_key = None, None
    for wgs in ((2, 1) if n % 128 == 0 else (1,)):
        for stages in range(4, max_stages + 1):
            for splits in (d for d in range(1, kb + 1) if kb % d == 0):
                cfg = DecodeGemmConfig(compute_wgs=wgs, stages=stages, splits=splits)
                if cfg.smem_bytes(m_pad) > HOPPER_SMEM_BYTES or kb // splits < min(stages, 4, kb):
                    continue
                key = rank(cfg)
                if best_key is None or key > best_key:
                    best, best_key = cfg, key
    if not stream_k or roofline(best, n, k, m, sms).wave_efficiency >= MIN_WAVE_EFFICIENCY:
        return best
    for wgs in ((2, 1) if n % 128 == 0 else (1,)):
        for stages in range(4, max_stages + 1):
            cfg = DecodeGemmConfig(compute_wgs=wgs, stages=stages, stream_k_ctas=sms)
            per, _ = cfg.stream_k_units(-(-n // cfg.cta_n), kb)
            if cfg.smem_bytes(m_pad) > HOPPER_SMEM_BYTES or per > kb or per < min(stages, 4) or stages > per:
                continue
            key = rank(cfg)
            if key > best_key:
                best, best_key = cfg, key
    return best


def candidate_configs(n: int, k: int, m: int) -> list[DecodeGemmConfig]:
    """The configurations the on-device tuner times for a shape (the first is :func:`choose_config`'s, the default):
    its neighbours with a 4-stage ring, twice and half the splits (when they divide the K blocks), the other
    warpgroup count, and the best split-K where the default is stream-K; only valid ones, no duplicates, and only
    those that pass issue 37 item 4's arithmetic checks (:func:`roofline`: wave efficiency >=
    :data:`MIN_WAVE_EFFICIENCY`, bytes in flight per SM >= :data:`MIN_BYTES_IN_FLIGHT_PER_SM`) wherever the default
    passes them (every Qwen3-8B and 30B-A3B decode shape), so a configuration the tuner ships never fails a check
    the default passes; a shape too small to fill the GPU (tests) keeps every neighbour."""
    base = choose_config(n, k, m)
    base_r = roofline(base, n, k, m)
    m_pad, kb = padded_tokens(m), -(-k // BLOCK_SIZE)
    out = [base]
    for cfg in (dataclasses.replace(base, stages=4), dataclasses.replace(base, splits=base.splits * 2),
                dataclasses.replace(base, splits=max(1, base.splits // 2)),
                dataclasses.replace(base, compute_wgs=3 - base.compute_wgs), choose_config(n, k, m, stream_k=False)):
        if cfg in out or (cfg.compute_wgs == 2 and n % 128):
            continue
        try:
            cfg.validate(m_pad, kb, n)
        except ValueError:
            continue
        r = roofline(cfg, n, k, m)
        if ((r.wave_efficiency < MIN_WAVE_EFFICIENCY <= base_r.wave_efficiency)
                or (r.bytes_in_flight_per_sm < MIN_BYTES_IN_FLIGHT_PER_SM <= base_r.bytes_in_flight_per_sm)):
            continue
        out.append(cfg)
    return out


def tuned_config(n: int, k: int, m: int) -> DecodeGemmConfig | None:
    """The configuration for a decode GEMM in this process: on a CUDA device, the fastest of
    :func:`candidate_configs` and XLA's own path (:func:`fp8rl_jax.kernels.mosaic_gemm.xla_w8a8_product`, candidate
    ``"xla"``; issue 37 item 3) as timed by :func:`fp8rl_jax.kernels.tuner.select` (op ``"decode_gemm"``, key ``N``,
    ``K`` and the M bucket; ``FP8RL_AUTOTUNE`` / ``train.autotune`` decide whether it times, reads the shipped and
    cached tables, or keeps the default); None when XLA's path measured fastest (the decode functions then compute
    the product that way); elsewhere (no GPU, a deviceless compile) :func:`choose_config`'s, which is also every
    candidate's reference."""
    from fp8rl_jax.kernels import tuner

    mb = min(MAX_TOKENS, tuner.m_bucket(m))
    # the candidates of the bucket's largest M: one candidate set per tuner key, whatever M of the bucket asks first
    # (valid for every M of it: a smaller token tile only needs less shared memory)
    cands = candidate_configs(n, k, mb)

    def make_args():
        import numpy as np

        rng = np.random.default_rng(0)
        kb = -(-k // BLOCK_SIZE)
        return (jnp.asarray(rng.standard_normal((mb, k)), jnp.float8_e4m3fn),
                jnp.asarray(rng.uniform(0.5, 2, (mb, kb)), jnp.float32),
                jnp.asarray(rng.standard_normal((n, k)), jnp.float8_e4m3fn),
                jnp.asarray(rng.uniform(0.5, 2, (-(-n // BLOCK_SIZE), kb)), jnp.float32))

    def runner(cfg):
        return lambda xq, xs, wq, ws: decode_w8a8_matmul(xq, xs, wq, ws, config=cfg)

    # candidates differ only in the float32 order of the K-block sums (~1e-7 relative): 1e-3 catches a lost or
    # doubled block (~1e-2 at these K) with room to spare
    xla = tuner.Candidate(XLA_CANDIDATE, None, xla_w8a8_product)
    chosen = tuner.select("decode_gemm", {"N": n, "K": k, "M<=": mb},
                          [tuner.Candidate(_config_name(c), c, runner(c), family="decode_gemm") for c in cands] + [xla],
                          make_args, tolerance=1e-3)
    return chosen.config


def _config_name(cfg: DecodeGemmConfig) -> str:
    if cfg.stream_k_ctas:
        return f"swapab(wgs={cfg.compute_wgs},stages={cfg.stages},stream_k={cfg.stream_k_ctas})"
    return f"swapab(wgs={cfg.compute_wgs},stages={cfg.stages},splits={cfg.splits})"


def _layout_fns(plgpu, interpret):
    """``(as_layout, token_scales)`` of a kernel body: compiled (``interpret`` None), ``plgpu.layout_cast`` and the
    ``[m_pad]`` token-scale row loaded in the WGMMA accumulator's column layout (one scale per column); in the
    interpreter, which has no layouts (and no ``plgpu.load``), the identity and a plain read."""
    if interpret is None:
        def token_scales(xs_s):  # [m_pad] token scales, one per accumulator column
            return plgpu.load(xs_s.at[0], (), layout=plgpu.Layout.WGMMA.reduce(0))

        return plgpu.layout_cast, token_scales

    def as_layout(x, layout):
        del layout
        return x

    def token_scales(xs_s):
        return xs_s[0, :]

    return as_layout, token_scales


def _block_product(plgpu, pl, w_s, x_s, wg, s):
    """One K block's promoted product for compute warpgroup ``wg``: the swap-AB wgmma of its 64 weight rows of
    ``w_s [cta_n, 128]`` with the tokens ``x_s [m_pad, 128]`` into a fresh float32 accumulator, times the
    ``[m_pad]`` scales ``s`` per column (DeepGEMM's promotion): ``[64, m_pad]`` float32."""
    m_pad = x_s.shape[0]

    def mma(p_ref):
        plgpu.wgmma(p_ref, w_s.at[pl.ds(wg * WG_ROWS, WG_ROWS)], plgpu.transpose_ref(x_s, (1, 0)))
        return p_ref[...]

    p = pl.run_scoped(mma, plgpu.ACC((WG_ROWS, m_pad), jnp.float32))
    return p * lax.broadcast_in_dim(s, (WG_ROWS, m_pad), (1,))


def swapab_tile(plgpu, pl, cfg: DecodeGemmConfig, m_pad: int, kps: int, interpret, w_ref, ws_ref, x_g, xs_g,
                tile, out_ref, ni, k0) -> None:
    """The body of one swap-AB CTA (inside a ``plgpu.kernel`` with a ``"wg"`` thread axis): the warp-specialized TMA
    pipeline over ``kps`` K blocks from ``k0`` of weight rows ``[ni cta_n, (ni + 1) cta_n)`` of ``w_ref [N_pad, K]``
    against token tile ``tile`` (rows ``[tile m_pad, (tile + 1) m_pad)`` of ``x_g``, columns of ``xs_g [kb, *]``),
    each block promoted by ``ws_ref[n // 128, kb]`` and the token scales, and the float32 ``[cta_n, m_pad]`` sum
    stored to rows ``ni cta_n ..`` of ``out_ref [N_pad, m_pad]``. The one tile body of the dense kernel
    (:func:`decode_w8a8_partials`) and the grouped one (:mod:`fp8rl_jax.kernels.decode_grouped_mgpu`)."""
    nwg, cta_n = cfg.compute_wgs, cfg.cta_n
    op_tr = _swizzled(plgpu, BLOCK_SIZE, jnp.float8_e4m3fn)
    out_tr = _swizzled(plgpu, m_pad, jnp.float32)
    as_layout, token_scales = _layout_fns(plgpu, interpret)
    wg = lax.axis_index("wg")
    nb = (ni * cta_n) // BLOCK_SIZE  # this CTA's weight-scale row

    def step(idx, w_s, x_s, xs_s, acc):
        (k,) = idx
        # the block's weight scale and token scales are read before the wgmma is waited on, so their load
        # latency (GMEM / SMEM) hides behind the tensor cores instead of adding to every K step
        s = token_scales(xs_s) * ws_ref[nb, k0 + k]  # [m_pad]: ws[n // 128, kb] * xs[m, kb]
        return acc + _block_product(plgpu, pl, w_s, x_s, wg, s)

    in_specs = [
        plgpu.BlockSpec((cta_n, BLOCK_SIZE), lambda k: (ni, k0 + k), transforms=op_tr),
        plgpu.BlockSpec((m_pad, BLOCK_SIZE), lambda k: (tile, k0 + k), transforms=op_tr),
        plgpu.BlockSpec((1, m_pad), lambda k: (k0 + k, tile)),
    ]

    @functools.partial(pl.run_scoped, o_s=plgpu.SMEM((nwg, WG_ROWS, m_pad), jnp.float32, transforms=out_tr),
                       collective_axes="wg")
    def _scope(o_s):
        def epilogue(run):
            acc = run(as_layout(jnp.zeros((WG_ROWS, m_pad), jnp.float32), plgpu.Layout.WGMMA))
            o_s[wg] = acc
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_s.at[wg], out_ref.at[pl.ds(ni * cta_n + wg * WG_ROWS, WG_ROWS)])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        plgpu.emit_pipeline_warp_specialized(
            step,
            grid=(kps,),
            memory_registers=cfg.memory_registers,
            in_specs=in_specs,
            wg_axis="wg",
            num_compute_wgs=nwg,
            max_concurrent_steps=cfg.stages,
            compute_context=epilogue,
        )(w_ref, x_g, xs_g)


def _build(np_: int, m_pad: int, kb: int, cfg: DecodeGemmConfig, interpret):
    """The ``plgpu.kernel``: ``(wq [np_, kb*128], xq [m_pad, kb*128], xsT [kb, m_pad] f32, ws [NB, kb] f32) ->
    partials f32 [splits, np_, m_pad]``."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    nwg, cta_n, splits = cfg.compute_wgs, cfg.cta_n, cfg.splits
    kps = kb // splits  # K blocks per split

    def body(w_g, x_g, xs_g, ws_g, o_g):
        ni, si = lax.axis_index("n"), lax.axis_index("s")
        swapab_tile(plgpu, pl, cfg, m_pad, kps, interpret, w_g, ws_g, x_g, xs_g, 0, o_g.at[si], ni, si * kps)

    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((splits, np_, m_pad), jnp.float32),
        grid=(np_ // cta_n, splits),
        grid_names=("n", "s"),
        num_threads=nwg + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret if interpret is not None else False,
        kernel_name="fp8_decode_gemm_swapab_wgmma",
    )


def _build_stream_k(np_: int, m_pad: int, kb: int, cfg: DecodeGemmConfig, interpret):
    """The stream-K ``plgpu.kernel``: operands as :func:`_build`; ``-> f32 [2 * ctas, cta_n, m_pad]``, block
    ``2 c + j`` = CTA ``c``'s partial of the ``j``-th tile its unit range touches (zeros where it touches one)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    nwg, cta_n = cfg.compute_wgs, cfg.cta_n
    tiles = np_ // cta_n
    per, ctas = cfg.stream_k_units(tiles, kb)
    total = tiles * kb
    op_tr = _swizzled(plgpu, BLOCK_SIZE, jnp.float8_e4m3fn)
    out_tr = _swizzled(plgpu, m_pad, jnp.float32)

    as_layout, token_scales = _layout_fns(plgpu, interpret)

    def body(w_g, x_g, xs_g, ws_g, o_g):
        ci, wg = lax.axis_index("c"), lax.axis_index("wg")
        u0 = ci * per
        t0 = u0 // kb  # the tile the range starts in

        def unit(k):  # step k of this CTA -> (tile, K block), clamped to the last unit past the end
            u = jnp.minimum(u0 + k, total - 1)
            return u // kb, u % kb

        def step(idx, w_s, x_s, xs_s, accs):
            (k,) = idx
            t, b = unit(k)
            live = (u0 + k < total).astype(jnp.float32)  # the last CTA's steps past the end add nothing
            w = ws_g[(t * cta_n) // BLOCK_SIZE, b] * live
            s = token_scales(xs_s) * w
            second = (t != t0).astype(jnp.float32)
            ps = _block_product(plgpu, pl, w_s, x_s, wg, s)
            acc0, acc1 = accs
            return acc0 + ps * (1.0 - second), acc1 + ps * second

        in_specs = [
            plgpu.BlockSpec((cta_n, BLOCK_SIZE), lambda k: unit(k), transforms=op_tr),
            plgpu.BlockSpec((m_pad, BLOCK_SIZE), lambda k: (0, unit(k)[1]), transforms=op_tr),
            plgpu.BlockSpec((1, m_pad), lambda k: (unit(k)[1], 0)),
        ]

        @functools.partial(pl.run_scoped, o_s=plgpu.SMEM((2, nwg, WG_ROWS, m_pad), jnp.float32, transforms=out_tr),
                           collective_axes="wg")
        def _scope(o_s):
            def epilogue(run):
                z = as_layout(jnp.zeros((WG_ROWS, m_pad), jnp.float32), plgpu.Layout.WGMMA)
                accs = run((z, z))
                for j in range(2):
                    o_s[j, wg] = accs[j]
                plgpu.commit_smem()
                for j in range(2):
                    plgpu.copy_smem_to_gmem(o_s.at[j, wg], o_g.at[2 * ci + j, pl.ds(wg * WG_ROWS, WG_ROWS)])
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

            plgpu.emit_pipeline_warp_specialized(
                step,
                grid=(per,),
                memory_registers=cfg.memory_registers,
                in_specs=in_specs,
                wg_axis="wg",
                num_compute_wgs=nwg,
                max_concurrent_steps=min(cfg.stages, per),
                compute_context=epilogue,
            )(w_g, x_g, xs_g)

    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((2 * ctas, cta_n, m_pad), jnp.float32),
        grid=(ctas,),
        grid_names=("c",),
        num_threads=nwg + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret if interpret is not None else False,
        kernel_name="fp8_decode_gemm_swapab_wgmma",
    )


def stream_k_gather(tiles: int, kb: int, per: int):
    """Static ``[S, tiles]`` indices into stream-K's ``2 * ctas`` partial blocks (``2 * ctas`` = a zero block):
    entry ``[j, t]`` is the ``j``-th CTA whose unit range (``per`` units from ``c * per``) touches tile ``t``."""
    import numpy as np

    ctas = -(-(tiles * kb) // per)
    cols = []
    for t in range(tiles):
        first, last = (t * kb) // per, ((t + 1) * kb - 1) // per
        cols.append([2 * c + (t - (c * per) // kb) for c in range(first, last + 1)])
    depth = max(len(c) for c in cols)
    return np.array([c + [2 * ctas] * (depth - len(c)) for c in cols], np.int32).T


@functools.partial(jax.jit, static_argnames=("cfg", "interpret"))
def _partials(xq, xs, wq, ws, *, cfg, interpret):
    m, _ = xq.shape
    kb = xs.shape[1]
    m_pad = padded_tokens(m)
    return _partials_t(_pad_to(xq, (m_pad, kb * BLOCK_SIZE)), _pad_to(xs.T, (kb, m_pad)), wq, ws, cfg=cfg,
                       interpret=interpret)


@functools.partial(jax.jit, static_argnames=("cfg", "interpret"))
def _partials_t(xq_p, xs_t, wq, ws, *, cfg, interpret):
    """The kernel on operands already in its layout: ``xq_p [m_pad, kb*128]``, ``xs_t [kb, m_pad]``."""
    m_pad, kp = xq_p.shape
    kb = xs_t.shape[0]
    n = wq.shape[0]
    np_ = -(-n // cfg.cta_n) * cfg.cta_n
    args = (_pad_to(wq, (np_, kp)), xq_p, xs_t, ws)
    if not cfg.stream_k_ctas:
        return _build(np_, m_pad, kb, cfg, _interpret_params(interpret))(*args)
    tiles = np_ // cfg.cta_n
    per, _ = cfg.stream_k_units(tiles, kb)
    blocks = _build_stream_k(np_, m_pad, kb, cfg, _interpret_params(interpret))(*args)
    blocks = jnp.concatenate([blocks, jnp.zeros((1,) + blocks.shape[1:], blocks.dtype)])
    idx = stream_k_gather(tiles, kb, per)                                      # [S, tiles]
    return blocks[idx].reshape(idx.shape[0], np_, m_pad)                       # [S, N_pad, M_pad] as split-K


def decode_w8a8_partials(xq: jax.Array, xs: jax.Array, wq: jax.Array, ws: jax.Array, *, interpret=False,
                         config: DecodeGemmConfig | None = None) -> jax.Array:
    """The kernel's split-K partial products, transposed: float32 ``[splits, N_pad, M_pad]`` (stream-K: ``S``, the
    most CTAs sharing a tile, blocks gathered from the CTAs' partials; zeros where fewer share it) with
    ``sum(partials, 0)[:N, :M].T`` the W8A8 product (:func:`decode_w8a8_matmul`). For a caller that fuses its own
    epilogue into the reduction (SwiGLU, residual).

    Args and Raises: as :func:`decode_w8a8_matmul`.
    """
    m, n, _, kb = check_operands(xq, xs, wq, ws, BLOCK_SIZE, "decode_w8a8_matmul")
    if jnp.dtype(xq.dtype) != jnp.dtype(jnp.float8_e4m3fn):
        raise ValueError(f"decode_w8a8_matmul: e4m3 operands only (vLLM's W8A8), got {xq.dtype}")
    m_pad = padded_tokens(m)
    cfg = _config_for(config, n, kb, m, interpret)
    if cfg is None:  # XLA's own path measured fastest: its product as one "split"
        return _xla_partials(xq, xs, wq, ws, m_pad)
    return _partials(xq, xs.astype(jnp.float32), wq, ws.astype(jnp.float32), cfg=cfg, interpret=interpret)


def _config_for(config, n: int, kb: int, m: int, interpret) -> DecodeGemmConfig | None:
    """``config`` checked, or (None given) the tuner's choice on a GPU (None: XLA's path), :func:`choose_config`'s
    in the interpreter; validated for ``padded_tokens(m)`` tokens and ``kb`` K blocks."""
    if config is None:  # measured on the device where a GPU is in this process (the tuner), by arithmetic elsewhere
        config = tuned_config(n, kb * BLOCK_SIZE, m) if interpret is False else choose_config(n, kb * BLOCK_SIZE, m)
        if config is None:
            return None
    config.validate(padded_tokens(m), kb, n)
    if not isinstance(interpret, bool):
        _interpret_params(interpret)
    return config


def _xla_partials(xq, xs, wq, ws, m_pad: int) -> jax.Array:
    """XLA's product in the partials' layout: float32 ``[1, N, m_pad]`` (rows of ``xq`` beyond its own zero)."""
    y = xla_w8a8_product(xq, xs, wq, ws)  # [rows, N]
    return _pad_to(y.T, (wq.shape[0], m_pad))[None]


def decode_w8a8_partials_t(xq_p: jax.Array, xs_t: jax.Array, wq: jax.Array, ws: jax.Array, *, m: int,
                           interpret=False, config: DecodeGemmConfig | None = None) -> jax.Array:
    """:func:`decode_w8a8_partials` on activations already in the kernel's layout, as
    :func:`fp8rl_jax.kernels.pallas_quant.quantize_activation_for_decode` writes them (no pad or transpose left
    for XLA to launch): float32 ``[splits, N_pad, m_pad]``, ``sum(partials, 0)[:N, :m].T`` the product.

    Args:
      xq_p: ``[m_pad, ceil(K/128)*128]`` e4m3, rows ``m..m_pad`` zero; ``m_pad = padded_tokens(m)``.
      xs_t: ``[ceil(K/128), m_pad]`` float32 activation ``scale_inv``, transposed.
      wq, ws: as :func:`decode_w8a8_matmul`.
      m: the real token count (the tuner's M bucket and the configuration's check).
      interpret, config: as :func:`decode_w8a8_matmul`.

    Raises:
      ValueError: ``m`` outside 1..64, ``xq_p`` / ``xs_t`` not ``[padded_tokens(m), kb*128]`` / ``[kb, m_pad]``
        e4m3 / float32 with ``kb = ceil(K/128)`` of ``wq``, the weight checks of :func:`decode_w8a8_matmul`.
    """
    m_pad = padded_tokens(m)
    n, k = wq.shape
    kb = -(-k // BLOCK_SIZE)
    if tuple(xq_p.shape) != (m_pad, kb * BLOCK_SIZE) or jnp.dtype(xq_p.dtype) != jnp.dtype(jnp.float8_e4m3fn):
        raise ValueError(f"decode_w8a8_partials_t: xq_p must be e4m3 [{m_pad}, {kb * BLOCK_SIZE}] (padded tokens, "
                         f"whole K blocks) for m={m} and wq {tuple(wq.shape)}, got {xq_p.dtype} {tuple(xq_p.shape)}")
    if tuple(xs_t.shape) != (kb, m_pad) or not jnp.issubdtype(xs_t.dtype, jnp.floating):
        raise ValueError(f"decode_w8a8_partials_t: xs_t must be float32 [{kb}, {m_pad}] (transposed scales), got "
                         f"{xs_t.dtype} {tuple(xs_t.shape)}")
    check_operands(jax.ShapeDtypeStruct((m, k), xq_p.dtype), jax.ShapeDtypeStruct((m, kb), xs_t.dtype), wq, ws,
                   BLOCK_SIZE, "decode_w8a8_partials_t")
    cfg = _config_for(config, n, kb, m, interpret)
    if cfg is None:  # XLA's own path measured fastest: its product as one "split"
        return _xla_partials(xq_p[:, :k], xs_t.T, wq, ws, m_pad)
    return _partials_t(xq_p, xs_t.astype(jnp.float32), wq, ws.astype(jnp.float32), cfg=cfg, interpret=interpret)


def decode_w8a8_matmul(xq: jax.Array, xs: jax.Array, wq: jax.Array, ws: jax.Array, *, out_dtype=jnp.float32,
                       interpret=False, config: DecodeGemmConfig | None = None) -> jax.Array:
    """W8A8 blockwise FP8 product for decode (1..64 tokens), swap-AB split-K on Hopper FP8 wgmma.

    ``y[m, n] = sum_kb (xq[m, kb] . wq[n, kb]) * xs[m, kb] * ws[n // 128, kb]`` (vLLM ``w8a8_block_fp8_matmul``,
    DeepGEMM promotion per K block; see the module docstring for the kernel and its roofline).

    Args:
      xq: ``[M, K]`` e4m3 activations (quantized by the caller, 1x128 groups: once per layer, outside the kernel).
      xs: ``[M, ceil(K/128)]`` float32 activation ``scale_inv``.
      wq: ``[N, K]`` e4m3 weights (vLLM ``[out, in]``); ws: ``[ceil(N/128), ceil(K/128)]`` float32 block scales.
      out_dtype: result dtype (the sum is float32).
      interpret: False (compile with Mosaic GPU for sm_90a), True (Mosaic GPU's interpreter on the CPU).
      config: :class:`DecodeGemmConfig`; default :func:`tuned_config` of ``(N, K, M)`` (the on-device tuner's choice
        among :func:`candidate_configs` on a GPU, :func:`choose_config`'s elsewhere).

    Returns:
      ``[M, N]`` in ``out_dtype``.

    Raises:
      ValueError: operand shapes/dtypes (:func:`fp8rl_jax.kernels.mosaic_gemm.check_operands`), non-e4m3 operands,
        ``M`` outside 1..64, a configuration that does not fit or whose ``splits`` does not divide the K blocks.
    """
    m, n = xq.shape[0], wq.shape[0]
    parts = decode_w8a8_partials(xq, xs, wq, ws, interpret=interpret, config=config)
    return jnp.sum(parts, axis=0)[:n, :m].T.astype(out_dtype)


def _selftest_decode_gemm(interpret=False) -> None:
    """Self-test of the ``decode_gemm`` family (this kernel), run once on the GPU on first use: 5 tokens x
    ``[200, 300]`` e4m3 (ragged M, N and K) with one compute warpgroup and no split, and 1 token x ``[256, 640]``
    with two warpgroups and split-K 5, and 3 tokens x ``[128, 640]`` by stream-K (2 one-warpgroup tiles x 5 K blocks
    over 4 CTAs of 3 units: ranges that cross a tile, steps past the end, a tile of 3 CTAs and one of 2, so the
    gather reads its zero block), each against the float64 product of the same e4m3 operands
    (:func:`fp8rl_jax.kernels.pallas_gemm.w8a8_reference`) to ``2**-10`` of the sum of |terms| (Hopper's FP8 wgmma keeps
    ~14 bits inside a K block; :data:`fp8rl_jax.kernels.mosaic_gemm.SELFTEST_RTOL`).

    Raises:
      fp8rl_jax.kernels.registry.KernelMismatch: a result outside the tolerance; a Mosaic GPU compile error unchanged.
    """
    from fp8rl_jax.kernels.registry import check_close
    from fp8rl_jax.kernels.mosaic_gemm import SELFTEST_RTOL
    from fp8rl_jax.kernels.pallas_gemm import selftest_operands, w8a8_reference

    for (m, n, k, seed), cfg in (((5, 200, 300, 1), DecodeGemmConfig(compute_wgs=1, stages=3, splits=1)),
                                 ((1, 256, 640, 2), DecodeGemmConfig(compute_wgs=2, stages=4, splits=5)),
                                 ((3, 128, 640, 3), DecodeGemmConfig(compute_wgs=1, stages=3, stream_k_ctas=4))):
        _, xq, xs, wq, ws = selftest_operands(m, n, k, seed=seed)
        y = decode_w8a8_matmul(*(jnp.asarray(a) for a in (xq, xs, wq, ws)), config=cfg, interpret=interpret)
        ref, bound = w8a8_reference(xq, xs, wq, ws)
        check_close(f"swap-AB decode GEMM M={m} N={n} K={k} {cfg}", y, ref, bound, SELFTEST_RTOL)


def _register_selftest() -> None:
    from fp8rl_jax.kernels.registry import register_selftest

    register_selftest("decode_gemm", _selftest_decode_gemm)


_register_selftest()


#: the Qwen3-8B decode GEMMs ``(name, N, K)``: fused q/k/v, o_proj, fused gate/up, down_proj
QWEN3_8B_DECODE = (("qkv", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up", 24576, 4096), ("down_proj", 4096, 12288))
#: the Qwen3-30B-A3B attention GEMMs (hidden 2048, 32 q / 4 kv heads of 128)
QWEN3_30B_A3B_DECODE = (("qkv", 5120, 2048), ("o_proj", 2048, 4096))


def main(argv=None) -> None:
    """Time the Qwen3-8B decode GEMMs (``--m`` tokens, default 1,8,16,64) per shape and candidate configuration
    (:func:`choose_config`'s and the same with a 4-stage ring), against XLA's bf16 ``dot_general`` of the same
    shape: microseconds per call in a jitted loop (:func:`fp8rl_jax.kernels.timing.per_call_us`) and the weight bytes
    over that time (TB/s; issue 37 item 1's goal: >= 80% of the HBM bandwidth at M <= 16). On a Hopper GPU;
    ``--smoke`` runs one tiny shape in Mosaic GPU's interpreter on the CPU (numbers meaningless).

    Raises:
      SystemExit: bad flags (argparse).
    """
    import numpy as np

    from fp8rl_jax.kernels.timing import main_parser, per_call_us, print_table

    p = main_parser("decode_gemm_mgpu", main.__doc__, iters=50)
    p.add_argument("--m", default="1,8,16,64")
    args = p.parse_args(argv)  # --smoke: one 2-token 128 x 256 product
    shapes, ms, iters = ((("tiny", 128, 256),), (2,), 1) if args.smoke else (
        QWEN3_8B_DECODE, [int(v) for v in args.m.split(",")], args.iters)
    rng = np.random.default_rng(0)
    rows = []
    for name, n, k in shapes:
        w = jnp.asarray(rng.standard_normal((n, k)) * 0.05, jnp.bfloat16)
        wq = w.astype(jnp.float8_e4m3fn)
        ws = jnp.ones((n // 128, k // 128), jnp.float32)
        for m in ms:
            x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
            xq = x.astype(jnp.float8_e4m3fn)
            xs = jnp.ones((m, k // 128), jnp.float32)
            bf16_us = per_call_us(lambda a, b: jnp.dot(a, b.T, preferred_element_type=jnp.float32), (x, w), iters)
            base = choose_config(n, k, m)
            cfgs = [base] if args.smoke else list(dict.fromkeys([base, dataclasses.replace(base, stages=4)]))
            for cfg in cfgs:
                us = per_call_us(functools.partial(decode_w8a8_matmul, config=cfg, interpret=args.smoke),
                                 (xq, xs, wq, ws), iters)
                rows.append((name, m, _config_name(cfg), us, n * k / us / 1e6, bf16_us, 2 * n * k / bf16_us / 1e6,
                             bf16_us / us))
    print_table("FP8 swap-AB decode GEMM vs bf16 dot_general", ("shape", "M", "config", "fp8 us", "fp8 TB/s", "bf16 us", "bf16 TB/s", "speedup"), rows)


if __name__ == "__main__":  # pragma: no cover
    main()
