"""Issue 37 item 4: a roofline table of the FP8 decode GEMM kernels, read on the CPU from their deviceless compile.

A deviceless sm_90a compile (:func:`fp8rl_jax.gpu_target.compile_for_h100`) proves what runs, not how fast. The
H200 profile of issue 37 showed what made the old decode kernels slow: too few CTAs for the SMs (1.45 waves),
a few KB in flight per SM where Little's law asks for 24-48 KB, and 0.5-1.0 warp-instructions per weight byte where
HBM speed allows about 0.1. Each of these can be read without a GPU, and this module reads them for the swap-AB
decode GEMM (:mod:`fp8rl_jax.kernels.decode_gemm_mgpu`) so that ``scripts/compile_h100.py`` fails when a shipped
configuration would be slow by construction:

* ``grid``, ``wave_efficiency``, ``bytes_in_flight_per_sm``: arithmetic of the configuration
  (:func:`fp8rl_jax.kernels.decode_gemm_mgpu.roofline`: CTAs over 132 SMs x the CTAs that fit one SM; the TMA
  ring's bytes per CTA x the CTAs resident per SM);
* ``loop_instructions_per_weight_byte``: **read from the compiled code**: the SASS instructions of one iteration of
  the kernel's warpgroup-MMA loop (one 128-wide K step; :func:`fp8rl_jax.sass.gmma_loop` on ptxas's build of the
  kernel's PTX, disassembled by ``nvdisasm``; without an ``nvdisasm``, the per-thread PTX instructions of the wgmma
  loop, :func:`fp8rl_jax.gpu_dump.wgmma_loop`: ``loop_code`` says which) x the warps of the compute warpgroups (4 per
  warpgroup) / the weight bytes that step streams (``cta_n x 128``, e4m3: one byte per element). SASS is what
  runs: ptxas moves loop arithmetic to the uniform datapath and folds a fresh accumulator's zeroing into the MMA's
  zero-accumulate form, so the SASS loop is shorter than the PTX one (Qwen3-8B down_proj prefill: 129 against 192). This is warp-instructions issued per weight byte: at 4.8 TB/s over 132 SMs (~36 B per SM per
  ns) and ~4 warp-instructions per SM per cycle at 1.98 GHz (~8 per ns), ~0.2 per byte saturates the issue slots,
  and the limit below (0.15) leaves room for the TMA warp and the memory system. The producer (TMA) warpgroup's
  instructions are not in it (one elected thread issues a few per stage);
* ``registers``, ``spills``: ``ptxas -v`` of the kernel (the CUDA plugin's report beside its PTX).

Checks (:func:`roofline_violations`, :func:`check_roofline`): ``wave_efficiency >= 0.9``,
``bytes_in_flight_per_sm >= 24576``, ``loop_instructions_per_weight_byte <= 0.15``, no spilled byte (issue 37).

The prefill GEMM (:mod:`fp8rl_jax.kernels.mosaic_gemm`, M >= 128) gets a record too (:func:`prefill_kernel_record`),
with the same fields read the same way (SASS loop: ``QGMMA`` issue of 4 x m64n128k32 per K block, 64 promotion
``FFMA`` and ~60 loop, barrier and address instructions), plus ``issue_per_mma_cycles``: a compute-bound GEMM is limited by the
tensor cores, not HBM, so what its K loop must not exceed is the tensor cores' time. Per K step the compute
warpgroups issue ``loop_instructions x 4 warps x compute_wgs`` warp-instructions on the SM's 4 schedulers (one each
per cycle) while their wgmmas take ``2 x cta_m x tile_n x 128 / 8192`` cycles (H100 SXM: 1,979 dense FP8 TFLOP/s =
132 SMs x 1.83 GHz x 8192 FLOP per cycle); the ratio of the two is the fraction of the MMA time the promotion,
barriers and loop control occupy the issue slots. Near or above 1, the promotion (DeepGEMM's, per 128-wide K block)
cannot hide behind the other warpgroup's wgmma and the kernel cannot reach the FP8 peak. Only the no-spill check
applies to prefill records (issue 37's thresholds are for the decode configurations); the ratio is reported.
Only the text readers and the checks run here without JAX; :func:`decode_kernel_record` imports the kernel module.
"""

from __future__ import annotations

import dataclasses
import glob
import os
from typing import Sequence

from fp8rl_jax.gpu_dump import parse_ptxas_info, ptx_entries, wgmma_loop
from fp8rl_jax.sass import gmma_loop

#: the least CTAs per wave that may be busy (issue 37: >= 0.9; the kernel's goal is 0.95)
MIN_WAVE_EFFICIENCY = 0.9
#: bytes each SM must have in flight: Little's law at 4.8 TB/s and ~0.7 us latency over 132 SMs (24 KiB; the same
#: number as ``fp8rl_jax.kernels.decode_gemm_mgpu.MIN_BYTES_IN_FLIGHT_PER_SM``)
MIN_BYTES_IN_FLIGHT_PER_SM = 24576
#: the most warp-instructions per weight byte one K step of the compute loop may issue (issue 37: ~0.1 reaches HBM
#: speed; the old kernels issued 0.5-1.0)
MAX_LOOP_INSTRUCTIONS_PER_WEIGHT_BYTE = 0.15
#: threads per warp and warps per warpgroup (Hopper)
WARPS_PER_WARPGROUP = 4
#: the K step of the decode GEMM's loop: one 128-wide K block (vLLM's 1x128 / 128x128 scale groups)
K_BLOCK = 128
#: the Mosaic GPU kernel name of the decode GEMM (``plgpu.kernel(..., kernel_name=...)``); its PTX is dumped as
#: ``<dump_dir>/mosaic_gpu/<name>_<n>.ptx`` with the entry ``<name>_mosaic_gpu_kernel``
DECODE_KERNEL_NAME = "fp8_decode_gemm_swapab_wgmma"
#: the Mosaic GPU kernel name of the dense prefill GEMM (:mod:`fp8rl_jax.kernels.mosaic_gemm`; its persistent-grid
#: configuration adds ``_persistent``)
PREFILL_KERNEL_NAME = "fp8_blockwise_gemm_wgmma"
#: the Mosaic GPU kernel name of the grouped (MoE expert) decode GEMM (:mod:`fp8rl_jax.kernels.decode_grouped_mgpu`)
GROUPED_DECODE_KERNEL_NAME = "fp8_grouped_decode_gemm_swapab_wgmma"
#: dense FP8 tensor-core FLOP per cycle of one Hopper SM (H100 SXM: 1,979 TFLOP/s / 132 SMs / 1.83 GHz)
FP8_MMA_FLOP_PER_CYCLE_PER_SM = 8192
#: warp schedulers per SM, each issuing one warp-instruction per cycle
ISSUE_SLOTS_PER_CYCLE = 4
#: SMs of an H100 SXM / H200
SMS = 132


class RooflineCheckError(ValueError):
    """A shipped decode GEMM configuration misses issue 37's roofline checks; ``violations`` lists them, one line
    each (``"<kernel>: <metric> = <value> (<limit>)"``)."""

    def __init__(self, violations: Sequence[str]):
        self.violations = list(violations)
        super().__init__("roofline check failed:\n  " + "\n  ".join(self.violations))


def loop_instructions_per_weight_byte(loop_instructions: int, compute_wgs: int, cta_n: int,
                                      k_block: int = K_BLOCK) -> float:
    """Warp-instructions per weight byte of a swap-AB FP8 K loop: ``loop_instructions`` (one iteration, per warp in
    SASS: :attr:`fp8rl_jax.sass.SassLoop.instructions`, or per thread in PTX: :attr:`fp8rl_jax.gpu_dump.PtxLoop.instructions`) x the warps of the ``compute_wgs`` compute
    warpgroups (4 each) / the weight bytes one iteration streams, ``cta_n x k_block`` (e4m3: 1 byte per element).

    Raises:
      ValueError: a non-positive warpgroup count, ``cta_n`` or ``k_block``, or a negative instruction count."""
    if compute_wgs < 1 or cta_n < 1 or k_block < 1 or loop_instructions < 0:
        raise ValueError(f"loop_instructions_per_weight_byte: need loop_instructions >= 0 and positive compute_wgs, "
                         f"cta_n, k_block; got {loop_instructions}, {compute_wgs}, {cta_n}, {k_block}")
    return loop_instructions * WARPS_PER_WARPGROUP * compute_wgs / (cta_n * k_block)


def loop_reading(ptx: str, sass: str | None, mma_per_step: int = 4) -> dict:
    """What one K-loop iteration of a compiled kernel issues, per thread (PTX) or per warp (SASS), as record fields.

    Args:
      ptx: the kernel's PTX (its loop: :func:`fp8rl_jax.gpu_dump.wgmma_loop`).
      sass: the SASS ptxas builds from that PTX (:func:`fp8rl_jax.sass.sass_of_ptx`), or None where no
        ``nvdisasm`` is installed.
      mma_per_step: the warpgroup MMAs of one step of the kernel's K loop (4 x k32 per 128-wide K block, times the
        K blocks per step).

    Returns:
      ``{"loop_instructions", "loop_code", "ptx_loop_instructions", "wgmma", "sass_gmma", "sass_loop_mma",
      "sass_loop_steps", "zero_accumulate_gmma"}``: ``loop_instructions`` is the SASS loop's count per step
      (:func:`fp8rl_jax.sass.gmma_loop`: what runs; ``loop_code`` ``"sass"``; divided by ``sass_loop_steps`` =
      the loop's MMAs (``sass_loop_mma``) / ``mma_per_step``, should ptxas unroll the loop) when ``sass`` is given,
      else the PTX loop's (``"ptx"``; an upper reading: ptxas removes, e.g., the zeroing of a fresh wgmma
      accumulator, which becomes the instruction's zero-accumulate form); the PTX count always; ``wgmma`` the PTX
      loop's wgmma forms; ``sass_gmma`` the SASS loop's warpgroup MMA opcodes (distinct, sorted) and
      ``zero_accumulate_gmma`` how many of its MMAs start from a zero accumulator (None without SASS).

    Raises:
      ValueError: no wgmma loop in the PTX, no warpgroup-MMA loop in the SASS, or a SASS loop whose MMA count is
        not a whole number of steps (not the K loop).
    """
    loop = wgmma_loop(ptx)
    out = {"loop_instructions": loop.instructions, "loop_code": "ptx", "ptx_loop_instructions": loop.instructions,
           "wgmma": sorted(f for f in loop.gemm_instructions if f.startswith("wgmma.")),
           "sass_gmma": None, "sass_loop_mma": None, "sass_loop_steps": None, "zero_accumulate_gmma": None}
    if sass is not None:
        sl = gmma_loop(sass)
        if len(sl.gmma) % mma_per_step:
            raise ValueError(f"the SASS loop {sl.label} holds {len(sl.gmma)} warpgroup MMAs, not a multiple of the "
                             f"{mma_per_step} of one K step: not the K loop")
        steps = len(sl.gmma) // mma_per_step
        per_step = sl.instructions // steps if sl.instructions % steps == 0 else round(sl.instructions / steps, 2)
        out.update(loop_instructions=per_step, loop_code="sass", sass_gmma=sorted(set(sl.gmma)),
                   sass_loop_mma=len(sl.gmma), sass_loop_steps=steps, zero_accumulate_gmma=sl.zero_accumulate)
    return out


def find_kernel_ptx(dump_dir: str, kernel_name: str = DECODE_KERNEL_NAME) -> tuple[str, str]:
    """``(PTX text, ptxas report text)`` of the Mosaic GPU kernel ``kernel_name`` in one program's dump
    (``<dump_dir>/mosaic_gpu/*.ptx`` whose entry is ``<kernel_name>_mosaic_gpu_kernel``, and the ``.ptxas`` file
    beside it; "" when the plugin wrote no report).

    Raises:
      FileNotFoundError: no PTX of that kernel in the dump (e.g. the plugin took it from its in-process cache,
        compiled and dumped by an earlier program of the same process).
      ValueError: several PTX files hold that kernel (one program compiled it at several shapes): the record
        would not know which is which."""
    entry = f"{kernel_name}_mosaic_gpu_kernel"
    found = []
    for path in sorted(glob.glob(os.path.join(dump_dir, "mosaic_gpu", "*.ptx"))):
        text = open(path, errors="replace").read()
        if entry in ptx_entries(text):
            found.append((path, text))
    if not found:
        raise FileNotFoundError(f"no PTX with the entry {entry} under {os.path.join(dump_dir, 'mosaic_gpu')}")
    if len(found) > 1:
        raise ValueError(f"{len(found)} PTX files hold {entry} in {dump_dir}: "
                         f"{', '.join(os.path.basename(p) for p, _ in found)}; compile one shape per program")
    path, text = found[0]
    rep = path[:-4] + ".ptxas"
    return text, (open(rep, errors="replace").read() if os.path.exists(rep) else "")


def decode_kernel_record(name: str, n: int, k: int, m: int, ptx: str, ptxas_report: str, cfg=None,
                         projection: str = "", sass: str | None = None, roofline=None,
                         kernel: str = DECODE_KERNEL_NAME) -> dict:
    """The roofline record of one compiled decode GEMM (:mod:`fp8rl_jax.kernels.decode_gemm_mgpu`).

    Args:
      name: the record's name (the compile program's, e.g. ``decode_gemm_8b_qkv_m1``).
      n, k, m: the product ``[m, k] x [n, k]``: weight rows, reduction, tokens.
      ptx: the kernel's PTX (:func:`find_kernel_ptx`); ptxas_report: its ``ptxas -v`` text ("" if none).
      cfg: the :class:`~fp8rl_jax.kernels.decode_gemm_mgpu.DecodeGemmConfig` it was compiled with (default
        ``choose_config(n, k, m)``: what ``decode_w8a8_matmul`` ships when given no config).
      projection: words for the shape (``"Qwen3-8B qkv"``).
      sass: the kernel's SASS (:func:`fp8rl_jax.sass.sass_of_ptx` of ``ptx``), or None (then the PTX's count).
      roofline: the configuration's :class:`~fp8rl_jax.kernels.decode_gemm_mgpu.Roofline` (default ``roofline(cfg,
        n, k, m)``, the dense kernel's); kernel: the Mosaic GPU kernel's name (its ptxas entry).

    Returns:
      ``{"name", "kernel", "shape": {"projection", "n", "k"}, "m", "config", "grid", "wave_efficiency",
      "bytes_in_flight_per_sm", "loop_instructions_per_weight_byte", "loop_instructions", "loop_code",
      "ptx_loop_instructions", "wgmma", "sass_gmma", "zero_accumulate_gmma",
      "estimated_loop_instructions_per_weight_byte", "registers", "spills", "spill_stores", "spill_loads"}``:
      the first metrics from ``roofline(cfg, n, k, m)``; ``loop_instructions`` (per K step) and the loop's MMA
      forms from the SASS when given, else the PTX (:func:`loop_reading`), and
      ``loop_instructions_per_weight_byte`` from them (:func:`loop_instructions_per_weight_byte`); the kernel
      module's own estimate beside it (``loop_instruction_count``); ``registers`` and ``spills`` (bytes, stores +
      loads) from the ptxas report (None when it has no entry).

    Raises:
      ValueError: the PTX has no wgmma loop (:func:`fp8rl_jax.gpu_dump.wgmma_loop`), the SASS no warpgroup-MMA
        loop, or ``m`` out of 1..64.
    """
    from fp8rl_jax.kernels import decode_gemm_mgpu as dg

    cfg = cfg or dg.choose_config(n, k, m)
    r = roofline or dg.roofline(cfg, n, k, m)
    lr = loop_reading(ptx, sass)
    entry = f"{kernel}_mosaic_gpu_kernel"
    info = parse_ptxas_info(ptxas_report).get(entry) or parse_ptxas_info(ptxas_report).get(wgmma_loop(ptx).entry)
    regs = info["registers"] if info and info["registers"] >= 0 else None
    return {"name": name, "kernel": kernel, "shape": {"projection": projection, "n": n, "k": k},
            "m": m, "config": dataclasses.asdict(cfg), "grid": list(r.grid),
            "wave_efficiency": round(r.wave_efficiency, 4), "bytes_in_flight_per_sm": r.bytes_in_flight_per_sm,
            "loop_instructions_per_weight_byte": round(
                loop_instructions_per_weight_byte(lr["loop_instructions"], cfg.compute_wgs, cfg.cta_n), 5),
            **lr,
            "estimated_loop_instructions_per_weight_byte": round(r.loop_instructions_per_weight_byte, 5),
            "registers": regs,
            "spills": (info["spill_stores"] + info["spill_loads"]) if info else None,
            "spill_stores": info["spill_stores"] if info else None,
            "spill_loads": info["spill_loads"] if info else None}


def grouped_decode_kernel_record(name: str, n: int, k: int, rows: int, ptx: str, ptxas_report: str, cfg,
                                 projection: str = "", sass: str | None = None,
                                 num_experts: int | None = None) -> dict:
    """The roofline record of one compiled grouped decode GEMM (MoE experts:
    :func:`fp8rl_jax.kernels.decode_grouped_mgpu.grouped_decode_w8a8_matmul`): :func:`decode_kernel_record`'s fields
    (the same checks apply) for ``rows`` routed rows over ``num_experts`` experts (default Qwen3-30B-A3B's 128):
    ``m`` is the tile's rows, and grid, wave efficiency and bytes in flight are those of the tiles expected in use
    (:func:`~fp8rl_jax.kernels.decode_grouped_mgpu.expected_tiles`; the CTAs of unused tiles exit at once), plus
    ``rows``, ``tiles`` (the static count) and ``tiles_expected``.

    Raises:
      ValueError: as :func:`decode_kernel_record`.
    """
    from fp8rl_jax.kernels import decode_grouped_mgpu as dgm

    e = num_experts or dgm.EXPERTS_30B_A3B
    m = dgm.decode_tile_rows(rows, e)
    used = dgm.expected_tiles(rows, e, m)
    rec = decode_kernel_record(name, n, k, m, ptx, ptxas_report, cfg=cfg, projection=projection, sass=sass,
                               roofline=dgm.grouped_decode_roofline(cfg, n, k, m, used), kernel=dgm.KERNEL_NAME)
    rec.update(rows=rows, tiles=dgm.decode_tiles(rows, e, m), tiles_expected=used)
    return rec


def prefill_kernel_record(name: str, n: int, k: int, m: int, ptx: str, ptxas_report: str, cfg,
                          projection: str = "", w_scales: str = "block", sass: str | None = None) -> dict:
    """The roofline record of one compiled prefill GEMM (:func:`fp8rl_jax.kernels.mosaic_gemm.mosaic_w8a8_matmul`).

    Args:
      name: the record's name (the compile program's, e.g. ``prefill_gemm_8b_qkv_m4096``).
      n, k, m: the product ``[m, k] x [n, k]``.
      ptx: the kernel's PTX (:func:`find_kernel_ptx` with :data:`PREFILL_KERNEL_NAME`); ptxas_report: its
        ``ptxas -v`` text ("" if none).
      cfg: the :class:`~fp8rl_jax.kernels.mosaic_gemm.MosaicGemmConfig` it was compiled with.
      projection: words for the shape.
      w_scales: the weight-scale layout it was compiled for (``"row"`` streams a ``[tile_n]`` scale row per K block).
      sass: the kernel's SASS (:func:`fp8rl_jax.sass.sass_of_ptx` of ``ptx``), or None (then the PTX's count).

    Returns:
      the fields of :func:`decode_kernel_record` (``kernel`` = the compiled kernel's name, ``"gemm": "prefill"``):
      ``grid`` (the CTA grid;
      ``[CTAs]`` for a persistent one), ``wave_efficiency`` (output tiles / (waves x 132 SMs), one CTA per SM: the
      ring fills the shared memory; a persistent grid of ``C`` CTAs runs ``ceil(tiles / C)`` waves),
      ``bytes_in_flight_per_sm`` (the TMA ring: ``stages x blocks_per_step x ((cta_m + tile_n) x 128 + scales)``),
      ``loop_instructions`` (per warp and loop iteration, from the SASS when given, else per thread from the PTX:
      :func:`loop_reading`; one pipeline step of ``blocks_per_step`` K blocks), ``loop_instructions_per_weight_byte`` (as the decode record: x warps / the ``tile_n x 128 x
      blocks_per_step`` weight bytes of the step), and ``issue_per_mma_cycles`` (the module docstring; the step's
      wgmmas), ``tiles``, registers and spills.

    Raises:
      ValueError: the PTX has no wgmma loop, or the SASS no warpgroup-MMA loop.
    """
    import math

    cta_m, tn, wgs = cfg.cta_m, cfg.tile_n, cfg.compute_wgs
    tiles = -(-m // cta_m) * -(-n // tn)
    slots = min(cfg.persistent_ctas, SMS) if cfg.persistent_ctas else SMS  # CTAs running at once
    wave_eff = tiles / (math.ceil(tiles / slots) * SMS)
    grid = [min(tiles, cfg.persistent_ctas)] if cfg.persistent_ctas else [-(-m // cta_m), -(-n // tn)]
    lr = loop_reading(ptx, sass, mma_per_step=4 * cfg.blocks_per_step)
    kernel = PREFILL_KERNEL_NAME + ("_persistent" if cfg.persistent_ctas else "")
    infos = parse_ptxas_info(ptxas_report)
    info = infos.get(f"{kernel}_mosaic_gpu_kernel") or infos.get(wgmma_loop(ptx).entry)
    regs = info["registers"] if info and info["registers"] >= 0 else None
    bps = cfg.blocks_per_step  # K blocks per loop iteration
    warp_instr = lr["loop_instructions"] * WARPS_PER_WARPGROUP * wgs
    mma_cycles = 2 * cta_m * tn * K_BLOCK * bps / FP8_MMA_FLOP_PER_CYCLE_PER_SM
    return {"name": name, "kernel": kernel, "gemm": "prefill",
            "shape": {"projection": projection, "n": n, "k": k}, "m": m, "config": dataclasses.asdict(cfg),
            "grid": grid, "tiles": tiles, "wave_efficiency": round(wave_eff, 4),
            "bytes_in_flight_per_sm": cfg.stages * cfg.stage_bytes(K_BLOCK, w_scales),
            "loop_instructions_per_weight_byte": round(
                loop_instructions_per_weight_byte(lr["loop_instructions"], wgs, tn, K_BLOCK * bps), 5),
            **lr,
            "issue_per_mma_cycles": round(warp_instr / ISSUE_SLOTS_PER_CYCLE / mma_cycles, 4),
            "registers": regs,
            "spills": (info["spill_stores"] + info["spill_loads"]) if info else None,
            "spill_stores": info["spill_stores"] if info else None,
            "spill_loads": info["spill_loads"] if info else None}


def is_prefill_record(record: dict) -> bool:
    """Whether ``record`` is a prefill GEMM's (:func:`prefill_kernel_record`: ``"gemm": "prefill"``), not a decode
    GEMM's."""
    return record.get("gemm") == "prefill"


def roofline_violations(record: dict) -> list[str]:
    """The checks one kernel record (:func:`decode_kernel_record`) misses, one line each naming the kernel
    (``record["name"]``) and the metric: ``wave_efficiency < 0.9``, ``bytes_in_flight_per_sm < 24576``,
    ``loop_instructions_per_weight_byte > 0.15``, ``spills > 0``; a metric that is missing (None: not read, e.g.
    no PTX or no ptxas report; the record's ``error`` is quoted) is a violation too. [] when it passes."""
    name = record.get("name", "?")
    out = []
    sh = record.get("shape") or {}
    known = None if is_prefill_record(record) else known_shortfall(sh.get("n"), sh.get("k"))

    def bad(metric, why):
        if metric == "wave_efficiency" and known and record.get(metric) is not None:
            return  # stated in the kernel's module (KNOWN_SHORTFALLS) and reported by known_shortfalls()
        out.append(f"{name}: {metric} {why}")

    checks = (("wave_efficiency", lambda v: v < MIN_WAVE_EFFICIENCY, f"< {MIN_WAVE_EFFICIENCY}"),
              ("bytes_in_flight_per_sm", lambda v: v < MIN_BYTES_IN_FLIGHT_PER_SM, f"< {MIN_BYTES_IN_FLIGHT_PER_SM}"),
              ("loop_instructions_per_weight_byte", lambda v: v > MAX_LOOP_INSTRUCTIONS_PER_WEIGHT_BYTE,
               f"> {MAX_LOOP_INSTRUCTIONS_PER_WEIGHT_BYTE}"),
              ("spills", lambda v: v > 0, "> 0 bytes"))
    if is_prefill_record(record):  # issue 37's thresholds are the decode configurations'; no spill is everyone's
        checks = checks[-1:]
    for metric, fails, limit in checks:
        v = record.get(metric)
        if v is None:
            err = record.get("error")
            bad(metric, "not measured" + (f" ({err.strip().splitlines()[0]})" if err else ""))
        elif fails(v):
            bad(metric, f"= {v:g} ({limit})")
    return out


def known_shortfall(n, k) -> str | None:
    """The stated reason (:data:`fp8rl_jax.kernels.decode_gemm_mgpu.KNOWN_SHORTFALLS`) why the decode GEMM of shape
    ``N x K`` misses the wave-efficiency check, or None. Such a record does not fail :func:`roofline_violations` on
    that metric (the others still apply); :func:`known_shortfalls` lists it so the compile report says it."""
    from fp8rl_jax.kernels.decode_gemm_mgpu import KNOWN_SHORTFALLS

    return KNOWN_SHORTFALLS.get((n, k))


def known_shortfalls(records: Sequence[dict]) -> list[str]:
    """One line per decode record below the wave-efficiency check for a stated reason (:func:`known_shortfall`)."""
    out = []
    for r in records:
        if is_prefill_record(r):
            continue
        sh = r.get("shape") or {}
        why = known_shortfall(sh.get("n"), sh.get("k"))
        v = r.get("wave_efficiency")
        if why and v is not None and v < MIN_WAVE_EFFICIENCY:
            out.append(f"{r.get('name', '?')}: wave_efficiency = {v:.3f} (< {MIN_WAVE_EFFICIENCY}, known: {why})")
    return out


def check_roofline(records: Sequence[dict]) -> None:
    """Raise :class:`RooflineCheckError` listing every violation (:func:`roofline_violations`) of ``records``;
    return None when all pass (an empty list passes)."""
    bad = [v for r in records for v in roofline_violations(r)]
    if bad:
        raise RooflineCheckError(bad)


def markdown_table(records: Sequence[dict]) -> list[str]:
    """The records as a Markdown table (lines), one row per kernel, a failed check in bold."""
    lines = ["| kernel | N x K | M | config (wgs, stages, splits) | grid | wave eff. | KiB in flight / SM | "
             "loop instr. / weight B (compiled code; estimate) | registers | spill B | wgmma |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]

    def fmt(v, spec, fails):
        if v is None:
            return "**?**"
        s = format(v, spec)
        return f"**{s}**" if fails(v) else s

    for r in records:
        sh, c = r.get("shape") or {}, r.get("config") or {}
        cfg = f"{c.get('compute_wgs')}, {c.get('stages')}, {c.get('splits')}" if c else ""
        grid = "x".join(str(g) for g in r.get("grid") or [])
        kib = r.get("bytes_in_flight_per_sm")
        kib = fmt(kib / 1024 if kib is not None else None, ",.1f", lambda v: v * 1024 < MIN_BYTES_IN_FLIGHT_PER_SM)
        est = r.get("estimated_loop_instructions_per_weight_byte")
        ipb = fmt(r.get("loop_instructions_per_weight_byte"), ".4f",
                  lambda v: v > MAX_LOOP_INSTRUCTIONS_PER_WEIGHT_BYTE)
        if r.get("loop_instructions") is not None:
            ipb += f" ({r['loop_instructions']} {(r.get('loop_code') or 'ptx').upper()} / K step)"
        if est is not None:
            ipb += f"; {est:.4f}"
        wgmma = "<br>".join(f.replace("wgmma.mma_async.sync.aligned.", "") for f in r.get("wgmma") or [])
        lines.append(
            f"| {r.get('name')} | {sh.get('projection', '')} {sh.get('n')} x {sh.get('k')} | {r.get('m')} | {cfg} "
            f"| {grid} | {fmt(r.get('wave_efficiency'), '.3f', lambda v: v < MIN_WAVE_EFFICIENCY)} "
            f"| {kib} "
            f"| {ipb} | {r.get('registers') if r.get('registers') is not None else '?'} "
            f"| {fmt(r.get('spills'), 'd', lambda v: v > 0)} | {wgmma} |")
    return lines


def prefill_markdown_table(records: Sequence[dict]) -> list[str]:
    """Prefill GEMM records (:func:`prefill_kernel_record`) as a Markdown table (lines), a spill in bold."""
    lines = ["| kernel | N x K | M | config (CTA tile, stages x K blocks, persistent CTAs) | grid (tiles) | wave eff. | "
             "KiB in flight / SM | loop instr. / step (SASS; PTX) | issue / MMA cycles | registers | spill B | wgmma |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        sh, c = r.get("shape") or {}, r.get("config") or {}
        cfg = (f"{64 * c.get('compute_wgs', 0)}x{c.get('tile_n')}, {c.get('stages')}x{c.get('blocks_per_step', 1)}, "
               f"{c.get('persistent_ctas') or '-'}") if c else ""
        grid = "x".join(str(g) for g in r.get("grid") or []) + f" ({r.get('tiles')})"
        kib = r.get("bytes_in_flight_per_sm")
        kib = f"{kib / 1024:,.1f}" if kib is not None else "?"
        sp = r.get("spills")
        wgmma = "<br>".join(f.replace("wgmma.mma_async.sync.aligned.", "") for f in r.get("wgmma") or [])
        ptx_n = r.get("ptx_loop_instructions", r.get("loop_instructions", "?"))
        loop = (f"{r.get('loop_instructions', '?')}; {ptx_n}" if r.get("loop_code") == "sass"
                else f"-; {ptx_n}")
        lines.append(
            f"| {r.get('name')} | {sh.get('projection', '')} {sh.get('n')} x {sh.get('k')} | {r.get('m')} | {cfg} "
            f"| {grid} | {r.get('wave_efficiency', '?')} | {kib} "
            f"| {loop} | {r.get('issue_per_mma_cycles', '?')} "
            f"| {r.get('registers') if r.get('registers') is not None else '?'} "
            f"| {('**?**' if sp is None else (f'**{sp}**' if sp else '0'))} | {wgmma} |")
    return lines
