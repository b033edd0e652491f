#!/usr/bin/env python
"""Compile every GPU program the project ships for an H100 (sm_90a) on this CPU machine, and read what it built.

    .venv-cuda/bin/python scripts/compile_h100.py                       # all programs -> benchmarks/results/
    .venv-cuda/bin/python scripts/compile_h100.py --only generate_fp8_b1 train_fp8_1dev --output_dir=/tmp/h100
    .venv-cuda/bin/python scripts/compile_h100.py --list

Needs the CUDA plugin (``make setup-cuda`` builds ``.venv-cuda`` with ``jax[cuda13]``); no GPU, no driver. Each
program is built from abstract arguments (``jax.ShapeDtypeStruct`` on a mesh of abstract H100s, the model made with
``nnx.eval_shape``: nothing is allocated), lowered for CUDA and compiled by XLA:GPU for sm_90a
(:func:`fp8rl_jax.gpu_target.compile_for_h100`). The programs:

* ``generate_*``: the embedded engine's jitted prefill + decode loop (``fp8rl_jax.rollout.engine._generate``) as
  :class:`~fp8rl_jax.rollout.engine.JaxRolloutEngine` runs it on one GPU (FP8: fused ``qkv_proj`` / ``gate_up_proj``,
  ``kv_attention="auto"``): bf16, FP8 W8A8, FP8 + e4m3 KV cache at Qwen3-8B widths, FP8 MoE at Qwen3-30B-A3B widths;
  b=1 and b=128 rows (32-token prompts, 16 decode steps: the loop body compiles the same for any step count), at 2
  decoder layers, and again at 4 for the per-layer kernel count.
* ``train_*``: the trainer's compiled train step (``CompiledTrainStep``, donated buffers, shardings from
  :mod:`fp8rl_jax.parallel.rules`, the model configured by ``trainer.model_setup.configure_train_model``) on a
  1-device and an 8-device (``fsdp=8``) mesh: bf16, fp16 (dynamic loss scaling), FP8 training (e4m3 forward) with
  bf16, e4m3 and e5m2 gradients, and Qwen3-30B-A3B with tiled experts (``train.expert_impl="tiled"``); 2 layers,
  8 rows x (64 + 192) tokens, float32 master weights and AdamW state.
* ``export_*``: the per-step FP8 export program (``fp8rl_jax.export._export``, as ``export_weights`` runs it:
  finiteness flags included) of float32 master weights at Qwen3-8B widths, plain and fused (the embedded engine's
  ``qkv_proj`` / ``gate_up_proj``), and of Qwen3-30B-A3B's expert stacks (``expert_stacks=True``); 2 layers.
* ``decode_gemm_*``: the FP8 decode GEMM kernel alone (``fp8rl_jax.kernels.decode_gemm_mgpu.decode_w8a8_matmul``,
  swap-AB wgmma, Mosaic GPU) at each Qwen3-8B decode shape (qkv, o_proj, gate_up, down_proj) and Qwen3-30B-A3B
  attention shape (qkv, o_proj), M = 1, 16, 64 tokens, with ``choose_config``'s configuration (what the kernel ships
  when called without one); one shape per compile (3-7 s each), so each PTX belongs to one record.
* ``prefill_gemm_*``: the FP8 prefill GEMM kernel alone (``fp8rl_jax.kernels.mosaic_gemm.mosaic_w8a8_matmul``,
  128x128 wgmma tiles) at the four Qwen3-8B prefill shapes, M = 4096, bf16 out, ``default_config``'s configuration.

Vocabulary: every program keeps the real 151,936 (the logits, sampling and ``lm_head`` GEMM compile at their real
shape; only the layer count is cut).

For each program the result has: ``compiled`` (or the error's first lines), ``compile_s`` (trace + lower + compile,
wall seconds, this machine), ``temp_bytes`` (XLA:GPU's temporaries per device), ``gemm_instructions`` (the distinct
``wgmma.mma_async...`` / ``mma.sync...`` forms in the PTX, operand types included: e4m3 operands mean FP8 tensor
cores), ``pallas_kernels`` and ``spills`` (``ptxas -v`` of each Pallas kernel's PTX: registers, spill bytes),
``custom_calls`` (cuDNN, cuBLAS, Triton, Mosaic GPU custom calls in the optimized HLO), ``notes`` (XLA's remarks on
compiling without the device), and for
a generate program ``kernels_per_token`` (device launches per decode step at 2 layers, from XLA's thunk sequence) and
``kernels_per_layer_per_token`` ((4-layer count - 2-layer count) / 2), ``gemm_bytes_per_layer_per_token`` (bytes
the decode loop's matrix-product launches move per layer: ``fp8rl_jax.gpu_dump.loop_body_gemm_bytes``, the same
difference) beside ``weight_bytes_per_layer`` and ``active_weight_bytes_per_layer`` (a layer's weights as the engine
holds them; MoE: the top-k experts one token reads), and ``kernels_built`` (distinct kernels XLA compiled at 2 layers:
``fp8rl_jax.gpu_dump.kernels_built``) with ``kernels_built_per_layer`` (the same difference).

``h100_compile.json`` also has ``"kernels"``: one roofline record per ``decode_gemm_*`` and ``prefill_gemm_*``
program (prefill: :func:`fp8rl_jax.kernel_roofline.prefill_kernel_record`, the same fields and
``issue_per_mma_cycles``; only its spill check applies); decode
(:func:`fp8rl_jax.kernel_roofline.decode_kernel_record`: ``name``, ``shape``, ``m``, ``config``, ``grid``,
``wave_efficiency``, ``bytes_in_flight_per_sm`` from the configuration's ``roofline()``;
``loop_instructions_per_weight_byte`` read from the kernel's SASS (``ptxas`` + ``nvdisasm``, :mod:`fp8rl_jax.sass`;
its warpgroup-MMA loop's instructions x the compute warps / the weight bytes of one K step; ``loop_code`` is
``"ptx"`` and the count the PTX loop's per-thread one where no ``nvdisasm`` is installed); ``registers`` and ``spills`` from ptxas), and ``.md`` a table of
them. Results: ``<output_dir>/h100_compile.json`` and ``.md``. Exit status: 0 when every program compiled and every
decode GEMM record passes issue 37's roofline checks; 1 when a program failed (each named with its error; the
others are still compiled and written) or a record misses a check (``ROOFLINE <program>: <metric> ...`` on stderr:
``wave_efficiency < 0.9``, ``bytes_in_flight_per_sm < 24576``, ``loop_instructions_per_weight_byte > 0.15``, any
spilled byte, or a metric that could not be read) or a generate program builds kernels per layer (``KERNEL REUSE
<program>: ...``: ``kernels_built_per_layer > 1``, :func:`kernel_reuse_violations`); 2 for a bad flag or a Python
without the CUDA plugin.

Programs run in ``--jobs`` worker processes (default 2: on a 2-core machine two compiles side by side finish sooner
than one after the other, since a compile leaves a core idle part of the time); a worker that crashes fails only its
program. Which kernels a program contains is decided by the project's code (``fp8rl_jax.fp8``) when it is lowered for
CUDA; this script only compiles and reads.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import json
import os
import re
import selectors
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

RESULT_TAG = "@@H100RESULT "
PROMPT_LEN, MAX_TOKENS = 32, 16
TRAIN_ROWS, TRAIN_PROMPT, TRAIN_RESPONSE = 8, 64, 192
LAYERS, LAYERS_FOR_COUNT = 2, 4


# Compile seconds measured here (2 layers; one worker): the scheduler starts the longest compiles first, so that two
# workers finish together. Only the order depends on them.
GENERATE_COST = {"bf16": (7, 9), "fp8": (10, 20), "fp8_kv": (12, 22), "moe_fp8": (17, 32)}  # (b=1, b=128)
TRAIN_COST = {"bf16": 10, "fp16": 12, "fp8": 31, "fp8_e4m3": 35, "fp8_e5m2": 63, "moe_tiled": 14}
KERNEL_COST = 4
#: tokens of the decode GEMM kernel programs (``decode_gemm_*``): b=1, a small and the largest decode batch
DECODE_GEMM_TOKENS = (1, 16, 64)
#: routed rows of the MoE expert decode GEMM programs (``decode_experts_*``): 1 and 32 tokens at top-8
DECODE_EXPERT_ROWS = (8, 256)
#: tokens of the prefill GEMM kernel programs (``prefill_gemm_*``): issue 37 item 2's M
PREFILL_GEMM_TOKENS = 4096


@dataclasses.dataclass(frozen=True)
class Program:
    """One program to compile: ``kind`` (generate / train / export) and its settings."""

    name: str
    kind: str
    model: str  # "8b" or "30b-a3b" (Qwen3 widths, fp8rl_jax.models.presets)
    precision: str = "bf16"  # generate: engine precision; train: train_precision; export: unused
    kv_cache: str = "auto"
    batch: int = 1
    devices: int = 1
    fp8_grad: str = "bf16"
    fuse: bool = False
    projection: str = ""  # kernel: which GEMM of the model (qkv, o_proj, gate_up, down_proj)
    n: int = 0  # kernel: weight rows N of the [M, K] x [N, K] product (M is ``batch``)
    k: int = 0  # kernel: reduction K
    cost: float = 10.0  # about the compile seconds, to start the longest first
    describe: str = ""
    mesh: str = ""  # train: a mesh shape over ``devices`` H100s ("" = fsdp over all of them)


def _programs() -> list[Program]:
    progs = []
    for prec, kv, model, label in (("bf16", "auto", "8b", "bf16"), ("fp8", "auto", "8b", "fp8"),
                                   ("fp8", "fp8_e4m3", "8b", "fp8_kv"), ("fp8", "auto", "30b-a3b", "moe_fp8")):
        for b in (1, 128):
            what = {"bf16": "bf16", "fp8": "FP8 W8A8", "fp8_kv": "FP8 W8A8 + e4m3 KV cache",
                    "moe_fp8": "FP8 W8A8 MoE"}[label]
            progs.append(Program(f"generate_{label}_b{b}", "generate", model, prec, kv, batch=b,
                                 cost=GENERATE_COST[label][b == 128],
                                 describe=f"engine generate, {what}, Qwen3-{model.upper()} widths, b={b}"))
    for prec, grad, model, label in (("bf16", "bf16", "8b", "bf16"), ("fp16", "bf16", "8b", "fp16"),
                                     ("fp8", "bf16", "8b", "fp8"),
                                     ("fp8", "e4m3", "8b", "fp8_e4m3"), ("fp8", "e5m2", "8b", "fp8_e5m2"),
                                     ("bf16", "bf16", "30b-a3b", "moe_tiled")):
        for dev in (1, 8):
            what = {"bf16": "bf16", "fp16": "fp16 (loss scaling)", "fp8": "FP8 (e4m3 fwd, bf16 grads)",
                    "fp8_e4m3": "FP8 (e4m3 fwd, e4m3 grads)",
                    "fp8_e5m2": "FP8 (e4m3 fwd, e5m2 grads)", "moe_tiled": "bf16 MoE, tiled experts"}[label]
            mesh = "1 device" if dev == 1 else "fsdp=8"
            progs.append(Program(f"train_{label}_{dev}dev", "train", model, prec, batch=TRAIN_ROWS, devices=dev,
                                 fp8_grad=grad, cost=TRAIN_COST[label] * (1.2 if dev == 8 else 1.0),
                                 describe=f"train step, {what}, Qwen3-{model.upper()} widths, {mesh}"))
    # issue 38: the 30B-A3B FP8-expert train step on the paper's 16 GPUs, fsdp only (today's) and with a host's 8
    # GPUs as one expert group (expert-parallel all-to-all dispatch); both record their collectives
    for mesh, label in (("fsdp=16", "fsdp16"), ("fsdp=2,expert=8", "fsdp2_expert8")):
        progs.append(Program(f"train_moe_fp8_{label}", "train", "30b-a3b", "fp8", batch=16, devices=16, mesh=mesh,
                             cost=TRAIN_COST["moe_tiled"] * 3,
                             describe=f"train step, FP8 (e4m3 fwd, bf16 grads) incl. experts, Qwen3-30B-A3B widths, "
                                      f"{mesh} (16 H100s)"))
    progs += [Program("export_fp8", "export", "8b", cost=3, describe="FP8 export, Qwen3-8B widths"),
              Program("export_fp8_fused", "export", "8b", fuse=True, cost=3,
                      describe="FP8 export, fused qkv/gate_up, Qwen3-8B widths"),
              Program("export_moe_fp8_stacks", "export", "30b-a3b", cost=4,
                      describe="FP8 export, expert stacks, Qwen3-30B-A3B widths")]
    from fp8rl_jax.kernels.decode_gemm_mgpu import QWEN3_8B_DECODE, QWEN3_30B_A3B_DECODE

    for model, shapes in (("8b", QWEN3_8B_DECODE), ("30b-a3b", QWEN3_30B_A3B_DECODE)):
        for proj, n, k in shapes:
            for m in DECODE_GEMM_TOKENS:
                progs.append(Program(f"decode_gemm_{model.replace('-', '_')}_{proj}_m{m}", "kernel", model, "fp8",
                                     batch=m, projection=proj, n=n, k=k, cost=KERNEL_COST,
                                     describe=f"FP8 decode GEMM (swap-AB wgmma), Qwen3-{model.upper()} {proj} "
                                              f"N={n} K={k}, M={m}, choose_config's configuration"))
    from fp8rl_jax.kernels.decode_grouped_mgpu import QWEN3_30B_A3B_EXPERTS

    for proj, n, k in QWEN3_30B_A3B_EXPERTS:
        for rows in DECODE_EXPERT_ROWS:
            progs.append(Program(f"decode_experts_30b_a3b_{proj}_r{rows}", "kernel", "30b-a3b", "fp8", batch=rows,
                                 projection=proj, n=n, k=k, cost=KERNEL_COST,
                                 describe=f"FP8 grouped decode GEMM (swap-AB wgmma per expert tile), Qwen3-30B-A3B "
                                          f"experts' {proj} N={n} K={k}, {rows} routed rows over 128 experts "
                                          f"({rows // 8} tokens at top-8), grouped_decode_config's configuration"))
    from fp8rl_jax.kernels.mosaic_gemm import QWEN3_8B_PREFILL

    for proj, n, k in QWEN3_8B_PREFILL:
        progs.append(Program(f"prefill_gemm_8b_{proj}_m{PREFILL_GEMM_TOKENS}", "kernel", "8b", "fp8",
                             batch=PREFILL_GEMM_TOKENS, projection=proj, n=n, k=k, cost=KERNEL_COST,
                             describe=f"FP8 prefill GEMM (128x128 wgmma tiles), Qwen3-8B {proj} N={n} K={k}, "
                                      f"M={PREFILL_GEMM_TOKENS}, default_config's configuration, bf16 out"))
    return progs


PROGRAMS = {p.name: p for p in _programs()}


# --------------------------------------------------------------------------------------------------------------------
# Building and compiling one program (worker side)

def _model_config(size: str, layers: int):
    from fp8rl_jax.models.presets import qwen3_config

    return dataclasses.replace(qwen3_config(size), num_hidden_layers=layers)


def _mesh(devices: int, shape: str = ""):
    from fp8rl_jax.gpu_target import h100_topology
    from fp8rl_jax.parallel.mesh import make_mesh

    shape = shape or ("" if devices == 1 else f"fsdp={devices}")
    return make_mesh(shape, devices=h100_topology(devices).devices)


def build(p: Program, layers: int):
    """``(fn, args, static_kwargs, mesh)`` of program ``p`` at ``layers`` decoder layers (abstract arguments)."""
    import jax
    import jax.numpy as jnp

    import plan  # scripts/plan.py: the same builders plan.py compiles

    cfg = _model_config(p.model, layers)
    mesh = _mesh(p.devices, p.mesh)
    if p.kind == "generate":
        from fp8rl_jax.rollout.engine import engine_fuses_projections

        fn, args, kw = plan.generate_program(cfg, mesh, p.precision, p.kv_cache, p.batch, PROMPT_LEN, MAX_TOKENS,
                                             n=1, fuse_projections=engine_fuses_projections(p.precision),
                                             kv_attention="auto")
        return fn, args, kw, mesh
    if p.kind == "train":
        from fp8rl_jax.trainer import TrainConfig

        tc = TrainConfig(model=f"Qwen3-{p.model}", train_precision=p.precision, fp8_train_grad=p.fp8_grad,
                         expert_impl="tiled" if cfg.num_experts else "auto")
        fn, args = plan.train_step_program(tc, cfg, mesh, p.batch, TRAIN_PROMPT, TRAIN_RESPONSE, None)
        return fn, args, {}, mesh
    if p.kind == "export":
        from flax import nnx

        from fp8rl_jax.export import _export
        from fp8rl_jax.fp8 import BLOCK_SIZE
        from fp8rl_jax.models.decoder import CausalLM, param_name
        from fp8rl_jax.models.fused import fused_projections

        # the trainer's master weights as ModelParamsReader reads them (expert stacks unsplit), float32
        model = nnx.eval_shape(lambda: CausalLM(cfg, param_dtype=jnp.float32, dtype=jnp.float32, rngs=nnx.Rngs(0)))
        params = {param_name(path): jax.ShapeDtypeStruct(v.shape, v.dtype)
                  for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
        fused = fused_projections({k: tuple(v.shape) for k, v in params.items()}, BLOCK_SIZE) if p.fuse else ()
        # export_weights(params, "fp8_blockwise", fuse=p.fuse, expert_stacks=MoE) runs exactly this program
        kw = dict(fmt="fp8_blockwise", block_size=BLOCK_SIZE, ue8m0=False, unquantized=(), check=True, stack=False,
                  fused=fused, keep_stacks=bool(cfg.num_experts))
        return _export, (params,), kw, mesh
    if p.kind == "kernel":
        fn, args, _ = kernel_program(p)
        return fn, args, {}, mesh
    raise ValueError(f"unknown program kind {p.kind!r}")


def kernel_program(p: Program):
    """``(fn, abstract args, config)`` of a ``kind="kernel"`` program, by its name's prefix."""
    if p.name.startswith("prefill_gemm"):
        return prefill_gemm_program(p)
    if p.name.startswith("decode_experts"):
        return decode_experts_program(p)
    return decode_gemm_program(p)


def decode_experts_program(p: Program):
    """``(fn, abstract args, config)`` of a ``decode_experts_*`` program: ``grouped_decode_w8a8_matmul`` of ``R``
    (``batch``) routed rows in the tile layout (``decode_tile_rows(R, 128)`` rows per tile, ``decode_tiles`` tiles)
    against a ``[128, N, K]`` e4m3 expert stack, ``grouped_decode_config``'s configuration (passed explicitly)."""
    import jax
    import jax.numpy as jnp

    from fp8rl_jax.kernels.decode_grouped_mgpu import (EXPERTS_30B_A3B, decode_tile_rows, decode_tiles,
                                                       grouped_decode_config, grouped_decode_w8a8_matmul)

    rows, n, k, e = p.batch, p.n, p.k, EXPERTS_30B_A3B
    m = decode_tile_rows(rows, e)
    g = decode_tiles(rows, e, m)
    cfg = grouped_decode_config(n, k, m, rows, e)
    s = jax.ShapeDtypeStruct
    kb = -(-k // 128)
    args = (s((g * m, k), jnp.float8_e4m3fn), s((g * m, kb), jnp.float32), s((e, n, k), jnp.float8_e4m3fn),
            s((e, -(-n // 128), kb), jnp.float32), s((g,), jnp.int32))
    return (lambda xq, xs, wq, ws, te: grouped_decode_w8a8_matmul(xq, xs, wq, ws, te, tile_rows=m, config=cfg,
                                                                  num_rows=rows)), args, cfg


def decode_gemm_program(p: Program):
    """``(fn, abstract args, config)`` of a ``decode_gemm_*`` program: ``decode_w8a8_matmul`` of e4m3
    ``[M, K]`` tokens (1x128 scales) and an e4m3 ``[N, K]`` weight (128x128 scales) with ``choose_config(N, K, M)``,
    the configuration the kernel ships when called without one (passed explicitly, so that the record's
    configuration is the compiled one)."""
    import jax
    import jax.numpy as jnp

    from fp8rl_jax.kernels.decode_gemm_mgpu import choose_config, decode_w8a8_matmul

    m, n, k = p.batch, p.n, p.k
    cfg = choose_config(n, k, m)
    s = jax.ShapeDtypeStruct
    args = (s((m, k), jnp.float8_e4m3fn), s((m, -(-k // 128)), jnp.float32), s((n, k), jnp.float8_e4m3fn),
            s((-(-n // 128), -(-k // 128)), jnp.float32))
    return (lambda xq, xs, wq, ws: decode_w8a8_matmul(xq, xs, wq, ws, config=cfg)), args, cfg


def prefill_gemm_program(p: Program):
    """``(fn, abstract args, config)`` of a ``prefill_gemm_*`` program: ``mosaic_w8a8_matmul`` of e4m3 ``[M, K]``
    activations (1x128 scales) and an e4m3 ``[N, K]`` weight (128x128 scales), bfloat16 out, with
    ``default_config(M, bfloat16, n=N)`` (what the kernel runs without a GPU to tune on; passed explicitly, so that
    the record's configuration is the compiled one)."""
    import jax
    import jax.numpy as jnp

    from fp8rl_jax.kernels.mosaic_gemm import default_config, mosaic_w8a8_matmul

    m, n, k = p.batch, p.n, p.k
    cfg = default_config(m, jnp.bfloat16, n=n)
    s = jax.ShapeDtypeStruct
    args = (s((m, k), jnp.float8_e4m3fn), s((m, -(-k // 128)), jnp.float32), s((n, k), jnp.float8_e4m3fn),
            s((-(-n // 128), -(-k // 128)), jnp.float32))
    return (lambda xq, xs, wq, ws: mosaic_w8a8_matmul(xq, xs, wq, ws, out_dtype=jnp.bfloat16, config=cfg)), args, cfg


def kernel_record(p: Program, dump: str) -> dict:
    """The roofline record of a ``decode_gemm_*`` program from its dump (:mod:`fp8rl_jax.kernel_roofline`): the
    configuration's grid, wave efficiency and bytes in flight; the wgmma loop's instructions per weight byte read
    from the kernel's SASS (ptxas + nvdisasm; the PTX where no nvdisasm is installed); registers and spills from its
    ptxas report. A reading error gives a record with the
    metrics it could not read as None and ``error`` (the check then fails on them)."""
    from fp8rl_jax.kernel_roofline import (PREFILL_KERNEL_NAME, decode_kernel_record, find_kernel_ptx,
                                           prefill_kernel_record)
    from fp8rl_jax.sass import find_nvdisasm, sass_of_ptx

    def sass_of(ptx):  # the loop's SASS when an nvdisasm is installed (make setup-cuda), else the PTX's count
        return sass_of_ptx(ptx) if find_nvdisasm() else None

    proj = f"Qwen3-{p.model.upper()} {p.projection}"
    if p.name.startswith("prefill_gemm"):
        _, _, cfg = prefill_gemm_program(p)
        try:
            name = PREFILL_KERNEL_NAME + ("_persistent" if cfg.persistent_ctas else "")
            ptx, report = find_kernel_ptx(dump, name)
            return prefill_kernel_record(p.name, p.n, p.k, p.batch, ptx, report, cfg, projection=proj,
                                         sass=sass_of(ptx))
        except (OSError, ValueError, RuntimeError) as e:
            return {"name": p.name, "kernel": PREFILL_KERNEL_NAME, "gemm": "prefill",
                    "shape": {"projection": proj, "n": p.n, "k": p.k},
                    "m": p.batch, "config": dataclasses.asdict(cfg), "spills": None,
                    "error": f"{type(e).__name__}: {e}"}
    if p.name.startswith("decode_experts"):
        from fp8rl_jax.kernel_roofline import GROUPED_DECODE_KERNEL_NAME, grouped_decode_kernel_record

        _, _, cfg = decode_experts_program(p)
        try:
            ptx, report = find_kernel_ptx(dump, GROUPED_DECODE_KERNEL_NAME)
            return grouped_decode_kernel_record(p.name, p.n, p.k, p.batch, ptx, report, cfg,
                                                projection=f"{proj} (experts)", sass=sass_of(ptx))
        except (OSError, ValueError, RuntimeError) as e:
            from fp8rl_jax.kernels.decode_grouped_mgpu import EXPERTS_30B_A3B, decode_tile_rows

            return {"name": p.name, "kernel": GROUPED_DECODE_KERNEL_NAME,
                    "shape": {"projection": proj, "n": p.n, "k": p.k},
                    "m": decode_tile_rows(p.batch, EXPERTS_30B_A3B), "rows": p.batch,
                    "config": dataclasses.asdict(cfg), "wave_efficiency": None, "bytes_in_flight_per_sm": None,
                    "loop_instructions_per_weight_byte": None, "registers": None, "spills": None,
                    "error": f"{type(e).__name__}: {e}"}
    _, _, cfg = decode_gemm_program(p)
    try:
        ptx, report = find_kernel_ptx(dump)
        return decode_kernel_record(p.name, p.n, p.k, p.batch, ptx, report, cfg=cfg, projection=proj,
                                    sass=sass_of(ptx))
    except (OSError, ValueError, RuntimeError) as e:
        from fp8rl_jax.kernels.decode_gemm_mgpu import roofline

        r = roofline(cfg, p.n, p.k, p.batch)
        return {"name": p.name, "shape": {"projection": proj, "n": p.n, "k": p.k}, "m": p.batch,
                "config": dataclasses.asdict(cfg), "grid": list(r.grid), "wave_efficiency": round(r.wave_efficiency, 4),
                "bytes_in_flight_per_sm": r.bytes_in_flight_per_sm, "loop_instructions_per_weight_byte": None,
                "registers": None, "spills": None, "error": f"{type(e).__name__}: {e}"}


def run_task(task: str, dump_root: str, keep_dumps: bool) -> dict:
    """Compile one task (``NAME`` at 2 layers, ``NAME@4`` at 4 for the kernel count) and analyze it."""
    import traceback

    from fp8rl_jax.gpu_dump import compile_error_summary
    from fp8rl_jax.gpu_target import compile_for_h100

    name, _, lay = task.partition("@")
    layers = int(lay) if lay else LAYERS
    p = PROGRAMS[name]
    dump = os.path.join(dump_root, task.replace("@", "_L"))
    out = {"task": task, "name": name, "layers": layers}
    t0 = time.perf_counter()
    try:
        fn, args, kw, mesh = build(p, layers)
        r = compile_for_h100(fn, *args, mesh=mesh, dump_dir=dump, **kw)
        if p.kind == "kernel":  # read the kernel's PTX before its dump goes
            out["kernel"] = kernel_record(p, dump)
    except Exception as e:  # any trace / lower / compile error: reported, the other programs go on
        out.update(compiled=False, compile_s=round(time.perf_counter() - t0, 1), error=compile_error_summary(e),
                   error_detail=(f"{type(e).__name__}: {e}"[:6000] + "\n" + traceback.format_exc()[-3000:]))
        return out
    finally:
        if not keep_dumps:
            shutil.rmtree(dump, ignore_errors=True)
    out.update(compiled=True, compile_s=round(r.compile_s, 1), temp_bytes=r.temp_bytes, memory=r.memory,
               gemm_instructions=r.gemm_instructions, gemm_instruction_counts=r.gemm_instruction_counts,
               pallas_kernels=r.pallas_kernels, spills=r.spills, custom_calls=r.custom_calls,
               loop_body_kernels=r.loop_body_kernels, loop_body_gemm_bytes=r.loop_body_gemm_bytes,
               loop_body_breakdown=r.loop_body_breakdown, kernels_built=r.kernels_built, notes=r.notes)
    if p.devices > 1:  # bytes per device of each collective kind, from the optimized HLO (fp8rl_jax.gpu_dump)
        from fp8rl_jax.gpu_dump import collective_bytes

        out["collectives"] = collective_bytes(r.compiled.as_text())
    return out


def worker_main(dump_root: str, keep_dumps: bool) -> int:
    """Read task names from stdin, one per line; write one ``RESULT_TAG + json`` line per task to stdout."""
    for line in sys.stdin:
        task = line.strip()
        if not task:
            continue
        res = run_task(task, dump_root, keep_dumps)
        sys.stdout.write(RESULT_TAG + json.dumps(res) + "\n")
        sys.stdout.flush()
    return 0


# --------------------------------------------------------------------------------------------------------------------
# Scheduling the tasks over worker processes (parent side)

class _Worker:
    def __init__(self, idx: int, dump_root: str, keep_dumps: bool, log_dir: str):
        self.idx, self.task, self.started = idx, None, 0.0
        self.log_path = os.path.join(log_dir, f"worker{idx}.log")
        self.log = open(self.log_path, "ab")
        env = dict(os.environ)
        env.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
        env.pop("JAX_COMPILATION_CACHE_DIR", None)  # measure real compiles, never a cache hit
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--dump_root", dump_root]
        if keep_dumps:
            cmd.append("--worker_keep")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, env=env,
                                     cwd=ROOT)
        self.buf = b""

    def send(self, task: str) -> None:
        self.task, self.started = task, time.perf_counter()
        self.log.flush()
        self.log_pos = os.path.getsize(self.log_path)
        self.proc.stdin.write((task + "\n").encode())
        self.proc.stdin.flush()

    def xla_notes(self) -> list[str]:
        """XLA's remarks about the deviceless compile logged while the current task ran (distinct lines), e.g. a
        sort that falls back because autotuning data needs a GPU: what the H100 program would do differently."""
        self.log.flush()
        with open(self.log_path, "rb") as f:
            f.seek(getattr(self, "log_pos", 0))
            text = f.read().decode(errors="replace")
        notes = []
        for line in text.splitlines():
            if not re.match(r"[WE]\d{4} ", line):  # glog warnings and errors only
                continue
            if "deviceless" in line.lower() or "autotun" in line.lower():
                msg = line.split("] ", 1)[-1].strip()
                if msg and msg not in notes:
                    notes.append(msg)
        return notes

    def log_tail(self, n: int = 12) -> str:
        self.log.flush()
        with open(self.log_path, "rb") as f:
            lines = f.read().decode(errors="replace").splitlines()
        lines = [x for x in lines if not x.startswith(("W0", "I0"))]
        return "\n".join(lines[-n:])

    def close(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def run_tasks(tasks: list[str], jobs: int, dump_root: str, keep_dumps: bool, log_dir: str) -> dict[str, dict]:
    """Run ``tasks`` (longest first, as given) on ``jobs`` workers; ``{task: result}``. A worker that dies fails its
    task (exit code + its stderr's last lines) and is replaced."""
    pending = list(tasks)
    results: dict[str, dict] = {}
    sel = selectors.DefaultSelector()
    workers: list[_Worker] = []
    next_idx = 0

    def start_worker():
        nonlocal next_idx
        w = _Worker(next_idx, dump_root, keep_dumps, log_dir)
        next_idx += 1
        workers.append(w)
        sel.register(w.proc.stdout, selectors.EVENT_READ, w)
        return w

    for _ in range(min(jobs, len(pending))):
        start_worker().send(pending.pop(0))
    while any(w.task is not None for w in workers):
        for key, _ in sel.select():
            w = key.data
            chunk = os.read(w.proc.stdout.fileno(), 65536)
            if not chunk:  # the worker died
                sel.unregister(w.proc.stdout)
                code = w.proc.wait()
                if w.task is not None:
                    name = w.task.partition("@")[0]
                    results[w.task] = {"task": w.task, "name": name, "compiled": False,
                                       "compile_s": round(time.perf_counter() - w.started, 1),
                                       "error": f"worker process died (exit code {code}) compiling {w.task}:\n"
                                                f"{w.log_tail()}"}
                    _progress(results[w.task])
                w.task = None
                workers.remove(w)
                w.close()
                if pending:
                    start_worker().send(pending.pop(0))
                continue
            w.buf += chunk
            while b"\n" in w.buf:
                line, w.buf = w.buf.split(b"\n", 1)
                text = line.decode(errors="replace")
                if not text.startswith(RESULT_TAG):
                    continue  # anything else a library printed
                res = json.loads(text[len(RESULT_TAG):])
                res["notes"] = list(res.get("notes") or []) + w.xla_notes()
                results[res["task"]] = res
                _progress(res)
                w.task = None
                if pending:
                    w.send(pending.pop(0))
    for w in workers:
        sel.unregister(w.proc.stdout)
        w.close()
    return results


def _progress(res: dict) -> None:
    status = "ok" if res.get("compiled") else "FAILED"
    extra = ""
    kr = res.get("kernel")
    if kr is not None:
        ipb = kr.get("loop_instructions_per_weight_byte")
        extra = (f", {ipb:.4f} loop warp-instructions / weight byte" if ipb is not None
                 else f", loop not read: {kr.get('error')}")
    if res.get("compiled") and res.get("loop_body_kernels") is not None and res["name"].startswith("generate"):
        extra = f", {res['loop_body_kernels']} kernels per loop iteration"
    print(f"[compile_h100] {res['task']:<30} {status:<6} {res['compile_s']:7.1f} s{extra}", flush=True)


# --------------------------------------------------------------------------------------------------------------------
# Merging and writing

def per_layer(at_layers, at_count_layers):
    """What one added decoder layer adds: ``(value at LAYERS_FOR_COUNT layers - value at LAYERS) / (LAYERS_FOR_COUNT -
    LAYERS)`` (the slope between the two compiles of a generate program)."""
    return (at_count_layers - at_layers) / (LAYERS_FOR_COUNT - LAYERS)


def merge(names: list[str], results: dict[str, dict]) -> list[dict]:
    """One record per program: the 2-layer compile's fields, plus for generate programs the per-layer kernel count
    from the 4-layer compile."""
    out = []
    for name in names:
        p = PROGRAMS[name]
        r = results.get(name, {"compiled": False, "error": "not run", "compile_s": 0.0})
        rec = {"name": name, "describe": p.describe, "kind": p.kind, "layers": LAYERS, "devices": p.devices,
               "compiled": bool(r.get("compiled")), "compile_s": r.get("compile_s"),
               "temp_bytes": r.get("temp_bytes"), "gemm_instructions": r.get("gemm_instructions"),
               "gemm_instruction_counts": r.get("gemm_instruction_counts"),
               "pallas_kernels": r.get("pallas_kernels"), "spills": r.get("spills"),
               "custom_calls": r.get("custom_calls"), "memory": r.get("memory"),
               "notes": r.get("notes") or []}
        if p.mesh:
            rec["mesh"] = p.mesh
        if r.get("collectives") is not None:
            rec["collectives"] = r["collectives"]
        if p.kind == "kernel":
            rec["batch"] = p.batch
            rec["kernel"] = r.get("kernel") if r.get("compiled") else None
        if not r.get("compiled"):  # paths relative to the repository (the results are committed)
            rec["error"] = (r.get("error") or "").replace(ROOT + os.sep, "")
            rec["error_detail"] = (r.get("error_detail") or "").replace(ROOT + os.sep, "")
        if p.kind == "generate":
            rec["batch"] = p.batch
            r4 = results.get(f"{name}@{LAYERS_FOR_COUNT}")
            k2 = r.get("loop_body_kernels") if r.get("compiled") else None
            rec["kernels_per_token"] = k2
            rec["kernels_per_token_breakdown"] = r.get("loop_body_breakdown")
            rec["kernels_per_layer_per_token"] = None
            rec["kernels_built"] = r.get("kernels_built") if r.get("compiled") else None
            rec["kernels_built_per_layer"] = None
            if r4 is not None:
                rec[f"compile_s_{LAYERS_FOR_COUNT}_layers"] = r4.get("compile_s")
                if not r4.get("compiled"):
                    rec["compiled"] = False
                    rec["error"] = ((rec.get("error") or "") + f"\n[{LAYERS_FOR_COUNT} layers] {r4.get('error')}"
                                    ).replace(ROOT + os.sep, "")
                elif k2 is not None and r4.get("loop_body_kernels") is not None:
                    per = per_layer(k2, r4["loop_body_kernels"])
                    rec["kernels_per_layer_per_token"] = per
                    rec["kernels_outside_layers_per_token"] = k2 - LAYERS * per
                    b2, b4 = r.get("loop_body_breakdown") or {}, r4.get("loop_body_breakdown") or {}
                    rec["kernels_per_layer_breakdown"] = {k: per_layer(b2.get(k, 0), b4.get(k, 0))
                                                          for k in sorted(set(b2) | set(b4))}
                if r4.get("compiled") and rec["kernels_built"] is not None and r4.get("kernels_built") is not None:
                    rec["kernels_built_per_layer"] = per_layer(rec["kernels_built"], r4["kernels_built"])
                g2, g4 = r.get("loop_body_gemm_bytes"), r4.get("loop_body_gemm_bytes")
                if r4.get("compiled") and g2 is not None and g4 is not None:
                    rec["gemm_bytes_per_layer_per_token"] = int(per_layer(g2, g4))
            rec.update(layer_weight_bytes(p))
        out.append(rec)
    return out


#: The most distinct kernels XLA may build per added decoder layer (``kernels_built_per_layer``, sorts aside:
#: :func:`fp8rl_jax.gpu_dump.kernels_built`). Identical layers compile to identical fusions, which XLA builds once.
#: Up to 1 leaves room for fusions of the shared prologue or of the residual stream whose grouping shifts as layers
#: are added (2026-11-29, from 2 to 4 layers: generate_fp8_kv_b1's RoPE sin/cos fusion split in two, +1; the b=128
#: programs' prefill residual adds of consecutive layers grouped differently, +2). Issue 37 item 5: the e4m3 KV
#: cache's per-layer scales, sliced into each layer's fusions, made XLA build 5.5 kernels per layer (36 Qwen3-8B
#: layers: 4 s more backend compile).
MAX_KERNELS_BUILT_PER_LAYER = 1.0


def kernel_reuse_violations(records: list[dict]) -> list[str]:
    """``"<program>: ..."`` for each generate record whose ``kernels_built_per_layer`` exceeds
    :data:`MAX_KERNELS_BUILT_PER_LAYER` (a fusion that differs from layer to layer, so XLA:GPU compiles it once per
    layer instead of once)."""
    out = []
    for r in records:
        per = r.get("kernels_built_per_layer")
        if per is not None and per > MAX_KERNELS_BUILT_PER_LAYER:
            out.append(f"{r['name']}: XLA builds {per:g} more kernels per decoder layer ({r['kernels_built']} at "
                       f"{LAYERS} layers; at most {MAX_KERNELS_BUILT_PER_LAYER:g}): some fusion differs from layer to "
                       "layer (a per-layer constant fused in?), so every layer compiles its own copy")
    return out


def layer_weight_bytes(p: Program) -> dict:
    """``{"weight_bytes_per_layer", "active_weight_bytes_per_layer"}`` of a generate program's model: the bytes of
    one decoder layer's linear weights as the engine holds them (e4m3 + float32 ``scale_inv`` per 128x128 block for
    FP8, 2 bytes per element for bf16; the router stays bf16), all experts, and those one token reads (its top-k
    experts). The reference for ``gemm_bytes_per_layer_per_token``: a decode step cannot read less than the active
    weights."""
    from fp8rl_jax.models.config import hf_param_shapes

    cfg = _model_config(p.model, 1)
    total = active = 0
    for name, shape in hf_param_shapes(cfg).items():
        if not name.startswith("model.layers.0.") or len(shape) != 2:
            continue
        n, k = shape
        if p.precision == "fp8" and not name.endswith("mlp.gate.weight"):
            b = n * k + 4 * (-(-n // 128)) * (-(-k // 128))
        else:
            b = 2 * n * k
        total += b
        active += b * cfg.num_experts_per_tok // cfg.num_experts if ".experts." in name else b
    return {"weight_bytes_per_layer": total, "active_weight_bytes_per_layer": active}


def _short_gemm(form: str) -> str:
    """``mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32`` -> ``mma.sync m16n8k16 bf16``,
    ``wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3`` -> ``wgmma m64n128k32 e4m3xe4m3``."""
    parts = form.split(".")
    shape = next((x for x in parts if x.startswith("m") and "n" in x and "k" in x and x[1].isdigit()), "")
    types = [x for x in parts if x in ("f16", "bf16", "tf32", "e4m3", "e5m2", "s8", "u8", "f64", "s4", "u4", "b1")]
    op = "wgmma" if parts[0] == "wgmma" else "mma.sync"
    if op == "wgmma":
        ab = "x".join(types[-2:]) if len(types) >= 2 else ",".join(types)
    else:
        ab = "x".join(types[:2]) if len(types) >= 2 else ",".join(types)
        if len(types) >= 2 and types[0] == types[1]:
            ab = types[0]
    return f"{op} {shape} {ab}".strip()


def write_outputs(records: list[dict], out_dir: str, jax_version: str, wall_s: float, jobs: int,
                  command: str) -> tuple[str, str]:
    """Write ``h100_compile.json`` (the records of :func:`merge` and the run's settings) and ``h100_compile.md``
    (one table row per program, then the decode GEMM kernels' roofline table, then each failure's error lines)
    under ``out_dir``; returns their paths. The JSON's ``"kernels"``: :func:`kernel_records`."""
    from fp8rl_jax.gpu_target import TARGET_DESCRIPTION
    from fp8rl_jax.kernel_roofline import (MAX_LOOP_INSTRUCTIONS_PER_WEIGHT_BYTE, MIN_BYTES_IN_FLIGHT_PER_SM,
                                           MIN_WAVE_EFFICIENCY, is_prefill_record, markdown_table,
                                           prefill_markdown_table)

    os.makedirs(out_dir, exist_ok=True)
    kernels = kernel_records(records)
    doc = {"programs": records, "kernels": kernels, "jax": jax_version, "target": TARGET_DESCRIPTION,
           "wall_s": round(wall_s, 1), "jobs": jobs, "command": command, "host_cpus": os.cpu_count(),
           "settings": {"layers": LAYERS, "layers_for_kernel_count": LAYERS_FOR_COUNT, "prompt_len": PROMPT_LEN,
                        "max_tokens": MAX_TOKENS, "train_rows": TRAIN_ROWS, "train_prompt": TRAIN_PROMPT,
                        "train_response": TRAIN_RESPONSE, "vocab": "real (151936)"}}
    jpath = os.path.join(out_dir, "h100_compile.json")
    with open(jpath, "w") as f:
        json.dump(doc, f, indent=2)
    lines = [f"# Every GPU program compiled for {TARGET_DESCRIPTION}", "",
             f"jax {jax_version}; {len(records)} programs, {sum(r['compiled'] for r in records)} compiled; "
             f"wall {wall_s:.0f} s with {jobs} worker(s) on {os.cpu_count()} CPU cores. Command: `{command}`.", "",
             f"Qwen3 widths at {LAYERS} layers (generate: also {LAYERS_FOR_COUNT}, for kernels per layer), real vocab; "
             f"generate: {PROMPT_LEN}-token prompts, {MAX_TOKENS} decode steps; train: {TRAIN_ROWS} rows x "
             f"({TRAIN_PROMPT} + {TRAIN_RESPONSE}) tokens. Kernels per layer per token = device launches per "
             f"decode-loop iteration, (at {LAYERS_FOR_COUNT} layers - at {LAYERS}) / {LAYERS_FOR_COUNT - LAYERS}; "
             "spills = ptxas bytes spilled (stores/loads) per Pallas kernel. GEMM MiB / layer / token = what the "
             "decode loop's matrix-product launches move per layer (each launch's result and distinct operands, "
             "from the optimized HLO: weights, scales, activations, split-K partials, and XLA's attention dots "
             "over the KV cache), against the layer's weights (e4m3 + scales for FP8; MoE: all experts / the "
             "top-k one token reads). Operands count whole, so this is an upper bound where a kernel reads part of "
             "one (the grouped expert kernel reads the routed experts' tiles of the whole stack it is passed); a "
             "product XLA compiles as a reduction fusion instead of a GEMM (bf16 b=1: k and v) is not counted.", "",
             "Kernels built = the distinct XLA-fusion and Pallas-Triton kernels XLA compiled at "
             f"{LAYERS} layers (identical fusions are built once), and how many more each added layer costs "
             f"(checked: at most {MAX_KERNELS_BUILT_PER_LAYER:g}).", "",
             "| program | compiled | compile s | kernels / layer / token (per token at 2 layers) | "
             "kernels built (+ per layer) | "
             "GEMM MiB / layer / token (weights MiB / layer) | GEMM instructions | "
             "Pallas kernels: registers, spill B | library calls | temp MiB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        secs = f"{r['compile_s']:.1f}" if r.get("compile_s") is not None else ""
        if r.get("compile_s_4_layers") is not None:
            secs += f" (+{r['compile_s_4_layers']:.1f} at 4 layers)"
        kpl = ""
        if r.get("kernels_per_layer_per_token") is not None:
            kpl = f"{r['kernels_per_layer_per_token']:g} ({r['kernels_per_token']})"
        elif r.get("kernels_per_token") is not None:
            kpl = f"? ({r['kernels_per_token']})"
        built = ""
        if r.get("kernels_built") is not None:
            per = r.get("kernels_built_per_layer")
            built = f"{r['kernels_built']}" + (f" (+{per:g})" if per is not None else "")
            if per is not None and per > MAX_KERNELS_BUILT_PER_LAYER:
                built = f"**{built}**"
        mib = ""
        if r.get("weight_bytes_per_layer") is not None:
            w, a = r["weight_bytes_per_layer"] / 2**20, r["active_weight_bytes_per_layer"] / 2**20
            wtxt = f"{w:,.1f}" if a == w else f"{w:,.1f} / {a:,.1f}"
            g = r.get("gemm_bytes_per_layer_per_token")
            mib = (f"{g / 2**20:,.1f} ({wtxt})" if g is not None else f"? ({wtxt})")
        gemm = "<br>".join(_short_gemm(g) for g in (r.get("gemm_instructions") or []))
        sp = r.get("spills")
        if sp is None:
            pallas = ", ".join(r.get("pallas_kernels") or []) or ("-" if r["compiled"] else "")
        else:
            pallas = "<br>".join(f"{k}: {v['registers']} reg, {v['spill_stores']}/{v['spill_loads']}"
                                 for k, v in sp.items()) or "none"
        temp = f"{r['temp_bytes'] / 2**20:,.0f}" if r.get("temp_bytes") is not None else ""
        ok = "yes" if r["compiled"] else "**NO**"
        libs = "<br>".join(f"{t} x{n}" for t, n in (r.get("custom_calls") or {}).items()
                           if t not in ("__gpu$xla.gpu.triton", "mosaic_gpu_v2", "mosaic_gpu"))
        lines.append(f"| {r['name']} | {ok} | {secs} | {kpl} | {built} | {mib} | {gemm} | {pallas} | {libs} | {temp} |")
    decode = [r for r in kernels if not is_prefill_record(r)]
    prefill = [r for r in kernels if is_prefill_record(r)]
    if decode:
        lines += ["", "## FP8 decode GEMM kernels: the roofline read from the compiled code", "",
                  "Each `decode_gemm_*` program compiles `decode_w8a8_matmul` (the swap-AB FP8 wgmma kernel, "
                  "`fp8rl_jax/kernels/decode_gemm_mgpu.py`) alone at one shape with `choose_config`'s "
                  "configuration. Grid, wave efficiency (CTAs / (waves x CTAs per wave) on 132 SMs) and KiB in "
                  "flight per SM (the TMA ring x CTAs resident per SM) follow from the configuration "
                  "(`roofline()`); loop instructions per weight byte are READ FROM THE COMPILED CODE: the SASS "
                  "instructions (ptxas, then nvdisasm; `SASS` in the cell; `PTX` where no nvdisasm is installed: "
                  "per-thread PTX, an mbarrier spin wait counted once) of one iteration of the warpgroup-MMA loop "
                  "(one 128-wide K step) x the compute warpgroups' warps / the weight bytes of that step (cta_n x 128), "
                  "beside the kernel module's estimate (`loop_instruction_count`); registers and spilled bytes "
                  "from ptxas. Checks (issue 37; a miss is in bold and fails the run): wave efficiency >= "
                  f"{MIN_WAVE_EFFICIENCY}, in flight >= {MIN_BYTES_IN_FLIGHT_PER_SM // 1024} KiB per SM, "
                  f"<= {MAX_LOOP_INSTRUCTIONS_PER_WEIGHT_BYTE} loop instructions per weight byte, no spill.", ""]
        lines += markdown_table(decode)
    if prefill:
        lines += ["", "## FP8 prefill GEMM kernels: the compiled K loop against the tensor cores' time", "",
                  "Each `prefill_gemm_*` program compiles `mosaic_w8a8_matmul` (the 128x128-tile FP8 wgmma GEMM, "
                  "`fp8rl_jax/kernels/mosaic_gemm.py`) alone at one Qwen3-8B shape, M = 4096, with "
                  "`default_config`'s configuration (on a GPU the autotuner may choose another). A prefill GEMM is "
                  "compute-bound: issue / MMA cycles = the compute warpgroups' warp-instructions of one K step "
                  "(READ FROM THE SASS; the PTX count beside it, which still holds the zeroing of each fresh "
                  "accumulator that ptxas folds into the MMA's zero-accumulate form) over the SM's 4 schedulers, divided by the cycles that step's wgmmas take "
                  "on the tensor cores at 8192 dense FP8 FLOP per cycle per SM (H100 SXM). Near 1, the per-K-block "
                  "promotion cannot hide behind the other warpgroup's wgmma. Wave efficiency counts output tiles "
                  "over 132 SMs. Check: no spill (issue 37's other thresholds are for the decode kernels).", ""]
        lines += prefill_markdown_table(prefill)
    failed = [r for r in records if not r["compiled"]]
    if failed:
        lines += ["", "## Failures", ""]
        for r in failed:
            lines += [f"### {r['name']}", "", "```", (r.get("error") or "").strip(), "```", ""]
    mpath = os.path.join(out_dir, "h100_compile.md")
    with open(mpath, "w") as f:
        f.write("\n".join(lines) + "\n")
    return jpath, mpath


def kernel_records(records: list[dict]) -> list[dict]:
    """The roofline records (``"kernels"`` of h100_compile.json) of the compiled ``decode_gemm_*`` and
    ``prefill_gemm_*`` programs."""
    return [r["kernel"] for r in records if r.get("kind") == "kernel" and r.get("kernel")]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--exclude", nargs="+", default=None, metavar="NAME",
                   help="skip these programs (names or shell patterns); `make test`'s lane skips the 16-device "
                        "'train_moe_fp8_fsdp*' (benchmarks/ep_mesh_model.py --compile runs them)")
    p.add_argument("--only", nargs="+", default=None, metavar="NAME",
                   help="compile only these programs (names or shell patterns, e.g. 'generate_fp8*')")
    p.add_argument("--output_dir", default=os.path.join(ROOT, "benchmarks", "results"))
    p.add_argument("--jobs", type=int, default=2, help="worker processes compiling side by side (default 2)")
    p.add_argument("--no_layer_count", action="store_true",
                   help=f"skip the {LAYERS_FOR_COUNT}-layer generate compiles (no kernels per layer)")
    p.add_argument("--layer_count_only", nargs="+", default=None, metavar="NAME",
                   help=f"compile the {LAYERS_FOR_COUNT}-layer copies of these generate programs only (names or shell "
                        "patterns; `make test`'s lane: generate_fp8_kv_b1, for its kernel-reuse check)")
    p.add_argument("--keep_dumps", default=None, metavar="DIR",
                   help="keep XLA's dumps (PTX, HLO, thunks; one folder per compile) and the workers' logs here")
    p.add_argument("--list", action="store_true", help="list the programs and exit")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dump_root", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker_keep", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.worker:
        return worker_main(args.dump_root, args.worker_keep)
    if args.list:
        for prog in PROGRAMS.values():
            print(f"{prog.name:<30} {prog.describe}")
        return 0
    names = list(PROGRAMS)
    if args.only:
        unknown = [pat for pat in args.only if not fnmatch.filter(names, pat)]
        if unknown:
            print(f"error: --only {' '.join(unknown)}: no such program; known: {', '.join(names)}", file=sys.stderr)
            return 2
        names = [n for n in names if any(fnmatch.fnmatch(n, pat) for pat in args.only)]
    if args.exclude:
        names = [n for n in names if not any(fnmatch.fnmatch(n, pat) for pat in args.exclude)]
    if args.jobs < 1:
        print("error: --jobs must be >= 1", file=sys.stderr)
        return 2

    from fp8rl_jax.gpu_target import CudaPluginMissing, h100_topology

    try:
        h100_topology(1)
    except CudaPluginMissing as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import jax

    tasks = [n for n in names]
    if not args.no_layer_count:
        counted = [n for n in names if PROGRAMS[n].kind == "generate" and (
            args.layer_count_only is None or any(fnmatch.fnmatch(n, pat) for pat in args.layer_count_only))]
        tasks += [f"{n}@{LAYERS_FOR_COUNT}" for n in counted]
    # a 4-layer compile costs about 1.5x (b=1) to 2x (b=128) the 2-layer one
    cost = {t: PROGRAMS[t.partition("@")[0]].cost * ((2.0 if PROGRAMS[t.partition("@")[0]].batch > 1 else 1.5)
                                                     if "@" in t else 1.0) for t in tasks}
    # The decode-GEMM kernel programs go first: the Mosaic GPU plugin compiles (and dumps) a kernel once per process,
    # so a kernel program run after a generate program that built the same kernel (b=1 at the same widths) finds no
    # PTX of its own to read its roofline record from (CI, 2026-11-27). Each kernel program builds one kernel, so the
    # generate programs after them still find theirs (gpu_target._MOSAIC_SEEN). Then the costliest first.
    tasks.sort(key=lambda t: (PROGRAMS[t.partition("@")[0]].kind != "kernel", -cost[t]))
    t0 = time.perf_counter()
    tmp = tempfile.mkdtemp(prefix="compile_h100_")
    dump_root = args.keep_dumps or os.path.join(tmp, "dumps")
    os.makedirs(dump_root, exist_ok=True)
    print(f"[compile_h100] {len(tasks)} compiles ({len(names)} programs) for sm_90a on {args.jobs} worker(s); "
          f"jax {jax.__version__}", flush=True)
    try:
        results = run_tasks(tasks, args.jobs, dump_root, args.keep_dumps is not None, args.keep_dumps or tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    wall = time.perf_counter() - t0
    records = merge(names, results)
    command = ("python scripts/compile_h100.py" + (f" --only {' '.join(args.only)}" if args.only else "")
               + (f" --exclude {' '.join(args.exclude)}" if args.exclude else "")
               + (f" --jobs={args.jobs}" if args.jobs != 2 else "") + (" --no_layer_count" if args.no_layer_count else "")
               + (f" --layer_count_only {' '.join(args.layer_count_only)}" if args.layer_count_only else ""))
    jpath, mpath = write_outputs(records, args.output_dir, jax.__version__, wall, args.jobs, command)
    print(f"[compile_h100] {sum(r['compiled'] for r in records)}/{len(records)} programs compiled in {wall:.0f} s; "
          f"wrote {os.path.relpath(jpath)} and {os.path.relpath(mpath)}")
    failed = [r for r in records if not r["compiled"]]
    for r in failed:
        print(f"FAILED {r['name']}: " + "\n    ".join((r.get("error") or "").strip().splitlines()[:6]),
              file=sys.stderr)
    from fp8rl_jax.kernel_roofline import known_shortfalls, roofline_violations

    slow = [v for rec in kernel_records(records) for v in roofline_violations(rec)]
    for v in slow:
        print(f"ROOFLINE {v}", file=sys.stderr)
    for v in known_shortfalls(kernel_records(records)):
        print(f"ROOFLINE (known shortfall, not a failure) {v}")
    rebuilt = kernel_reuse_violations(records)
    for v in rebuilt:
        print(f"KERNEL REUSE {v}", file=sys.stderr)
    return 1 if failed or slow or rebuilt else 0


if __name__ == "__main__":
    sys.exit(main())
