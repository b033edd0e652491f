"""Issue 29: the FP8 GEMMs of CUDA programs with M >= 128 rows run the Mosaic GPU wgmma kernel (FP8 tensor cores).

What is chosen where (one place each): :func:`fp8rl_jax.fp8.dot_general.cuda_gemm_impl` for dense products (the
engine's FP8 linears through ``w8a8_block_matmul``, FP8 training's forward and its e4m3 backward): the Triton
split-K decode kernel for M <= 64, the Mosaic kernel above (64 < M < 128 with 64-row CTAs), XLA's FP8 dot for
e5m2 x e4m3; :func:`fp8rl_jax.models.moe.grouped_expert_kernel` for MoE experts (Mosaic on 64/128-row tiles for
prefill-sized routed row counts, the Triton grouped kernel for decode-sized ones).

(a) Numerics in Mosaic GPU's interpreter on the CPU of the integrated dense path (``w8a8_block_matmul(impl=
"mosaic")``: activation quantization, leading dims, padding, output dtype) at M = 1, 17, 64, 65, 300, 520 against a
float64 evaluation of the formula on numpy-quantized operands (tests/fp8_numpy_ref.py). FP8 training with
``grad="e4m3"`` is checked the same way in tests/test_fp8_training.py, the MoE block in tests/test_moe.py, the
batched (grouped) kernel in tests/test_mosaic_gemm.py. The ``w8a8_gemm`` family's self-test passes with the real
kernel (interpret mode) and rejects a wrong one. CPU-lowered ``"auto"`` programs are unchanged (bit for bit the
dequantize path, no kernel).

(b) Lowering for CUDA (StableHLO, against an abstract H100, :func:`fp8rl_jax.gpu_target.lowering_for_h100`; no CUDA
plugin needed): which custom calls each program launches, counted through the call graph.

(c) A deviceless sm_90a compile in .venv-cuda (subprocess): the PTX of an FP8 linear at Qwen3-8B shapes (M = 4096,
N = K = 4096), the MoE experts at Qwen3-30B-A3B widths (hidden 2048, moe_intermediate 768, 128 experts, top-8,
1024 tokens: a prefill) and FP8 training forward + backward with ``grad="e4m3"`` (M = 2048 tokens, the 8B
``gate_proj``: N = 12288, K = 4096) holds ``wgmma.mma_async...e4m3.e4m3`` and no f16 ``mma.sync``; the training
program writes no wide float copy of any operand (its operand transposes are of e4m3 bytes only).

Interpret mode costs ~1.3 s per CTA on this 2-core CPU, so the shapes keep N <= 64 (one column tile) here.
"""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8_numpy_ref as ref
from hlo_calls import is_kernel, triton_launches
from fp8rl_jax.fp8 import dot_general as dg
from fp8rl_jax.fp8 import formats, linear, training
from fp8rl_jax.kernels import registry, mosaic_gemm
from fp8rl_jax.gpu_target import lowering_for_h100

S = jax.ShapeDtypeStruct
E4M3 = jnp.float8_e4m3fn
U = 2.0 ** -24
REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------------------------------------------
# (a) numerics in interpret mode


def _linear_case(m, n, k, seed, lead=()):
    """x float32 ``[*lead, m, k]`` with row / group magnitudes over e^+-3, an e4m3 weight in 128x128 blocks."""
    rng = np.random.default_rng(seed)
    kb = -(-k // 128)
    x = rng.standard_normal((*lead, m, k)) * np.exp(rng.uniform(-3, 3, (*lead, m, 1)))
    x = x * np.repeat(np.exp(rng.uniform(-3, 3, (1, kb))), 128, axis=1)[:, :k]
    w = rng.standard_normal((n, k)) * 0.05 * np.exp(rng.uniform(-2, 2, (n, 1)))
    wq, ws = ref.quantize_blocks(w.astype(np.float32), 128, 128, formats.WEIGHT_RECIPE)
    return x.astype(np.float32), wq, ws


def _f64_linear(x, wq, ws):
    """float64 ``(y, A)`` of the W8A8 formula with the activations quantized by the numpy reference (vLLM
    ``QuantFP8`` native rounding), and ``A`` the same sum on absolute values (the tolerance's scale)."""
    k = x.shape[-1]
    xq, xs = ref.quantize_blocks(x.reshape(-1, k), 1, 128, formats.ACTIVATION_RECIPE)
    xd = ref.dequantize_blocks(xq, xs, 1, 128)
    wd = ref.dequantize_blocks(wq, ws, 128, 128)
    return (xd @ wd.T).reshape(*x.shape[:-1], -1), (np.abs(xd) @ np.abs(wd).T).reshape(*x.shape[:-1], -1)


def float32_bound(a, kb):
    """Worst-case float32 error of the kernel (first order in u = 2**-24, see tests/test_mosaic_gemm.py): the
    in-block sum of 128 exact e4m3 products (127 u), the scale product and the scaled partial (2 u), the KB - 1
    block additions; all within ``(128 + KB + 2) u`` of ``A``, the formula on absolute values."""
    return (128 + kb + 2) * U * a


@pytest.mark.parametrize("lead,m,dtype", [((), 1, "float32"), ((), 17, "float32"), ((), 64, "float32"),
                                          ((5,), 13, "bfloat16"), ((), 300, "bfloat16"), ((), 520, "float32")])
def test_linear_mosaic_matches_float64_formula(lead, m, dtype):
    """``w8a8_block_matmul(impl="mosaic")``: the activations quantized in 1x128 groups (XLA), then the kernel in
    Mosaic GPU's interpreter. N = 60 and K = 200 are ragged (zero padding to 64 and 256); at N = 60 every M takes the
    64 x 64 tiles (a 128 x 128 grid would occupy a few of the 132 SMs: :func:`~fp8rl_jax.kernels.mosaic_gemm.
    default_config`; the 128 x 128 configuration's numerics are tests/test_mosaic_gemm.py's, its PTX (c) below):
    M = 520 is 9 CTA rows, the last one 8 rows deep; ``[5, 13, K]`` is a 65-row GEMM (two 64-row CTAs). bfloat16
    cases: bfloat16 activations in, bfloat16 written by the kernel's epilogue. Tolerance: the float32 bound
    (:func:`float32_bound`), plus bfloat16's rounding of the result (2**-8 relative) for a bfloat16 output. The
    activation quantization must equal the numpy reference bit for bit (else the error would be e4m3-sized, ~2**-4
    of a term, far above the bound)."""
    x, wq, ws = _linear_case(m, 60, 200, seed=m, lead=lead)
    x = jnp.asarray(x, dtype)
    t = time.perf_counter()
    y = linear.w8a8_block_matmul(x, jnp.asarray(wq), jnp.asarray(ws), impl="mosaic")
    assert y.dtype == jnp.dtype(dtype) and y.shape == (*lead, m, 60)
    y = np.asarray(y, np.float64)
    y_ref, a = _f64_linear(np.asarray(x, np.float32), wq, ws)
    tol = float32_bound(a, 2)
    if dtype == "bfloat16":
        tol = tol + 2.0 ** -8 * (np.abs(y_ref) + tol)
    r = float(np.max(np.abs(y - y_ref) / np.maximum(tol, 1e-300)))
    print(f"M={m} {dtype}: max |err| / bound = {r:.3g} ({time.perf_counter() - t:.1f} s)")
    assert r <= 1.0


def test_cpu_auto_paths_are_the_dequantize_path_bit_for_bit():
    """Lowered for the CPU nothing changed: ``"auto"`` is the dequantize path (bit for bit, both for the engine's
    linear and for the FP8 dot_general at M >= 128 and M <= 64), and the CPU program holds no kernel."""
    for m in (300, 5):
        x, wq, ws = _linear_case(m, 60, 200, seed=3)
        args = (jnp.asarray(x), jnp.asarray(wq), jnp.asarray(ws))
        np.testing.assert_array_equal(np.asarray(jax.jit(lambda *a: linear.w8a8_block_matmul(*a))(*args)),
                                      np.asarray(linear.w8a8_block_matmul(*args, impl="dequant")))
        dn = (((1,), (1,)), ((), ()))
        w = jnp.asarray(ref.dequantize_blocks(wq, ws, 128, 128), jnp.float32)
        auto = dg.make_fp8_dot_general(impl="auto")(args[0], w, dn)
        np.testing.assert_array_equal(np.asarray(auto), np.asarray(dg.make_fp8_dot_general(impl="dequant")(
            args[0], w, dn)))
        cpu = jax.jit(lambda *a: linear.w8a8_block_matmul(*a)).trace(*args).lower(lowering_platforms=("cpu",))
        assert "mosaic_gpu" not in cpu.as_text() and "triton" not in cpu.as_text()


def test_w8a8_gemm_selftest_is_the_mosaic_kernels_and_catches_a_wrong_one(monkeypatch):
    """The ``w8a8_gemm`` family's registered self-test is the Mosaic kernel's (registered at import of
    :mod:`fp8rl_jax.fp8`); with the kernel in Mosaic GPU's interpreter it passes (dense M = 130 on the 128 x 128
    tiles, grouped 1D1D on 64 x 64 tiles), and a kernel whose result is off by 2**-6 (a wrong scale) or that drops
    the last K block fails with KernelMismatch. Those wrong kernels are stood in by a float64-exact XLA evaluation
    (fast), perturbed."""
    assert registry._selftests["w8a8_gemm"] is mosaic_gemm._selftest_w8a8_gemm
    t = time.perf_counter()
    mosaic_gemm._selftest_w8a8_gemm(interpret=True)
    print(f"self-test in interpret mode: {time.perf_counter() - t:.1f} s")

    def exact(xq, xs, wq, ws, w_scales, drop_last=False):
        xs = jnp.asarray(xs, jnp.float32)
        if drop_last:
            xs = xs.at[:, -1].set(0.0)
        ws = jnp.asarray(ws, jnp.float32)
        rows = ws if w_scales == "row" else jnp.repeat(ws, 128, axis=0)[:wq.shape[0]]
        return dg.scaled_matmul(xq[None], xs[None], wq[None], rows[None], impl="dequant")[0]

    def fake_dense(xq, xs, wq, ws, *, out_dtype, cfg, interpret, w_scales, how):
        y = exact(xq, xs, wq, ws, w_scales, drop_last=how == "drop")
        return (y * (1 + 2.0 ** -6) if how == "scale" else y).astype(out_dtype)

    def fake_grouped(xq, xs, wq, ws, tile_group, *, tile_rows, out_dtype, cfg, interpret, w_scales, how):
        parts = [exact(xq[i * tile_rows:(i + 1) * tile_rows], xs[i * tile_rows:(i + 1) * tile_rows], wq[e], ws[e],
                       w_scales, drop_last=how == "drop") for i, e in enumerate(np.asarray(tile_group))]
        y = jnp.concatenate(parts)
        return (y * (1 + 2.0 ** -6) if how == "scale" else y).astype(out_dtype)

    for how in ("scale", "drop"):
        monkeypatch.setattr(mosaic_gemm, "_dense", lambda *a, **kw: fake_dense(*a, **kw, how=how))
        monkeypatch.setattr(mosaic_gemm, "_grouped", lambda *a, **kw: fake_grouped(*a, **kw, how=how))
        with pytest.raises(registry.KernelMismatch):
            mosaic_gemm._selftest_w8a8_gemm(interpret=True)
    monkeypatch.setattr(mosaic_gemm, "_dense", lambda *a, **kw: fake_dense(*a, **kw, how="none"))
    monkeypatch.setattr(mosaic_gemm, "_grouped", lambda *a, **kw: fake_grouped(*a, **kw, how="none"))
    mosaic_gemm._selftest_w8a8_gemm(interpret=True)  # the exact product passes


def test_a_jax_without_the_mosaic_api_imports_and_falls_back_to_xla():
    """Mosaic GPU is imported inside the kernel builder only: with ``jax.experimental.pallas.mosaic_gpu`` unimportable
    (as an API that moved in another jax would be), ``fp8rl_jax`` still imports, and the first CUDA program with a
    W8A8 GEMM runs the ``w8a8_gemm`` self-test (the CPU standing in for the GPU), which fails, warns once, and the
    program takes XLA's path (no Mosaic call). In a subprocess (a fresh import state)."""
    script = textwrap.dedent("""
        import sys, warnings
        sys.modules["jax.experimental.pallas.mosaic_gpu"] = None
        import jax, jax.numpy as jnp
        import fp8rl_jax.fp8, fp8rl_jax.models.moe, fp8rl_jax.fp8.training
        from fp8rl_jax.fp8 import linear
        from fp8rl_jax.kernels import registry
        from fp8rl_jax.gpu_target import lowering_for_h100
        registry.cuda_device = lambda: jax.devices("cpu")[0]
        S = jax.ShapeDtypeStruct
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with lowering_for_h100():
                hlo = jax.jit(lambda *a: linear.w8a8_block_matmul(*a)).trace(
                    S((200, 256), jnp.bfloat16), S((256, 256), jnp.float8_e4m3fn), S((2, 2), jnp.float32)
                ).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" not in hlo, "the Mosaic kernel was staged"
        assert any("failed its self-test" in str(w.message) for w in caught), [str(w.message) for w in caught]
        assert "mosaic_gpu" in registry.selftest_failures()["w8a8_gemm"], registry.selftest_failures()
        print("ok")
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-2000:] + proc.stderr[-4000:]


def test_cuda_gemm_impl_is_the_one_choice_by_m():
    """The rule itself: the swap-AB decode kernel up to 64 rows of one batch (issue 37), Mosaic above (65..127
    included), XLA's FP8 dot for mixed formats; batched products always Mosaic."""
    assert [dg.cuda_gemm_impl(m) for m in (1, 64)] == [("decode_gemm", "swapab")] * 2
    assert [dg.cuda_gemm_impl(m) for m in (65, 127, 128, 4096)] == [("w8a8_gemm", "mosaic")] * 4
    assert dg.cuda_gemm_impl(4, decode_ok=False) == ("w8a8_gemm", "mosaic")
    assert dg.cuda_gemm_impl(4, batch=3) == ("w8a8_gemm", "mosaic")
    assert dg.cuda_gemm_impl(4096, mosaic_ok=False, decode_ok=False) == (None, "blocked")
    e4, e5 = dg.OperandQuant("group", "e4m3"), dg.OperandQuant("group", "e5m2")
    blk = dg.OperandQuant("block", "e4m3")
    assert dg.mosaic_operands(e4, blk) and dg.mosaic_operands(e4, e4) and not dg.mosaic_operands(e5, blk)
    assert dg.decode_operands(e4, blk) and not dg.decode_operands(e4, blk, ue8m0=True)
    assert not dg.decode_operands(dg.OperandQuant("group", "e4m3", training.GRAD_E4M3), blk)
    cfg = mosaic_gemm.default_config
    assert (cfg(65).cta_m, cfg(65).tile_n, cfg(128).cta_m, cfg(128).tile_n) == (64, 64, 128, 128)


# ----------------------------------------------------------------------------------------------------------------
# (b) lowering for CUDA

_MOSAIC_NAME = re.compile(r"fp8_blockwise_(?:grouped_)?gemm_wgmma(?:_1d1d)?|fp8_(?:grouped_)?decode_gemm_swapab_wgmma")


def _launch_kind(line: str) -> str:
    if "stablehlo.custom_call @mosaic_gpu" in line:
        m = _MOSAIC_NAME.search(line)
        return "mosaic:" + (m.group(0) if m else "?")
    m = re.search(r'\bname = "([^"]+)"', line)
    return "triton:" + (m.group(1) if m else "?")


def launches(hlo: str) -> collections.Counter:
    """Kernel launches that ``@main`` of a lowered StableHLO module executes, through ``call`` edges
    (tests/hlo_calls.py): ``"mosaic:<kernel name>"`` per Mosaic GPU custom call, ``"triton:<kernel name>"`` per
    Pallas-Triton one."""
    return triton_launches(hlo, kind=_launch_kind, match=is_kernel)


def mosaic_operand_types(hlo: str) -> list[str]:
    """The operand type list of every Mosaic GPU custom call site (text occurrence, not launches), e.g.
    ``tensor<384x256xf8E4M3FN>, ...``."""
    return [m.group(1) for line in hlo.splitlines() if "stablehlo.custom_call @mosaic_gpu" in line
            for m in [re.search(r"\}\s*:\s*\((.*?)\)\s*->\s*tensor<[^>]*>\s*$", line)] if m]


def _cuda(fn, *args) -> str:
    with lowering_for_h100():
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _linear_args(m, n=256, k=256, lead=()):
    return (S((*lead, m, k), jnp.bfloat16), S((n, k), E4M3), S((-(-n // 128), -(-k // 128)), jnp.float32))


@pytest.mark.parametrize("m,want", [(1, "mosaic:fp8_decode_gemm_swapab_wgmma"),
                                    (20, "mosaic:fp8_decode_gemm_swapab_wgmma"),  # 24 padded tokens
                                    (64, "mosaic:fp8_decode_gemm_swapab_wgmma"),
                                    (65, "mosaic:fp8_blockwise_gemm_wgmma"), (128, "mosaic:fp8_blockwise_gemm_wgmma"),
                                    (4096, "mosaic:fp8_blockwise_gemm_wgmma")])
def test_linear_lowers_to_the_quant_kernel_and_one_gemm_chosen_by_m(m, want):
    """The engine's FP8 linear (``"auto"``): two launches, a ``quant`` family kernel (1x128 groups) and the GEMM:
    for M <= 64 the decode operand quantizer (``pallas_quant.quantize_activation_for_decode``, which writes the
    padded values and transposed scales the swap-AB decode kernel reads: no pad or transpose of them is left to
    XLA) and the swap-AB kernel; above, ``quantize_activation_groupwise_dispatch`` and the Mosaic GEMM; both GEMMs
    with two e4m3 operands."""
    quant = "triton:fp8_decode_operand_quant" if m <= 64 else "triton:fp8_blockwise_quant"
    hlo = _cuda(lambda *a: linear.w8a8_block_matmul(*a), *_linear_args(m))
    assert launches(hlo) == collections.Counter({quant: 1, want: 1}), launches(hlo)
    assert all(t.count("f8E4M3FN") == 2 for t in mosaic_operand_types(hlo))
    if m <= 64:  # the quantizer's outputs go to the kernel as they are
        assert not re.search(r"stablehlo\.pad\b[^\n]*->\s*tensor<[^>]*f8E4M3FN", hlo), "a pad of e4m3 values"
        m_pad, kb = max(8, -(-m // 8) * 8), 2  # K = 256: the transposed scales are [2, m_pad]
        assert not re.search(rf"stablehlo\.transpose\b[^\n]*->\s*tensor<{kb}x{m_pad}xf32>", hlo), \
            "XLA transposes the scales"
    # leading dims count as rows: [2, 150, K] is a 300-row GEMM
    assert launches(_cuda(lambda *a: linear.w8a8_block_matmul(*a), *_linear_args(150, lead=(2,)))) == \
        collections.Counter({"triton:fp8_blockwise_quant": 1, "mosaic:fp8_blockwise_gemm_wgmma": 1})
    with registry.kernel_mode_scope("xla"):  # kernels off: no launch at all (the quantizer is XLA's too)
        assert launches(_cuda(lambda *a: linear.w8a8_block_matmul(*a), *_linear_args(m))) == collections.Counter()


def test_linear_quantizes_in_xla_where_the_quant_kernel_is_off_or_the_format_is_not_e4m3(monkeypatch):
    """The ``quant`` family failing its self-test leaves the GEMM kernel and quantizes the input with XLA's jnp
    quantizer (no Triton launch); e5m2 activations never take the kernel (its self-test covers e4m3 only)."""
    from fp8rl_jax.kernels.pallas_quant import quantize_activation_groupwise_dispatch

    passed = registry.selftest_passed
    monkeypatch.setattr(registry, "selftest_passed", lambda family: family != "quant" and passed(family))
    assert launches(_cuda(lambda *a: linear.w8a8_block_matmul(*a), *_linear_args(1))) == \
        collections.Counter({"mosaic:fp8_decode_gemm_swapab_wgmma": 1})
    monkeypatch.setattr(registry, "selftest_passed", passed)
    e5m2 = _cuda(lambda x: quantize_activation_groupwise_dispatch(x, fp8_dtype=jnp.float8_e5m2, fp8_max=57344.0),
                 S((4, 256), jnp.bfloat16))
    e4m3 = _cuda(quantize_activation_groupwise_dispatch, S((4, 256), jnp.bfloat16))
    assert launches(e5m2) == collections.Counter() and launches(e4m3) == collections.Counter(
        {"triton:fp8_blockwise_quant": 1})


def test_xla_mode_lowers_no_kernel():
    with registry.kernel_mode_scope("xla"):
        assert launches(_cuda(lambda *a: linear.w8a8_block_matmul(*a), *_linear_args(300))) == collections.Counter()


def test_fp8_dot_general_lowers_by_m():
    """The FP8 ``dot_general`` (Flax layers) in "auto": Mosaic at M = 300, the swap-AB decode kernel at M = 17."""
    dn = (((1,), (1,)), ((), ()))
    f = dg.fp8_block_dot_general
    assert launches(_cuda(lambda x, w: f(x, w, dn), S((300, 256), jnp.bfloat16), S((384, 256), jnp.bfloat16))) == \
        collections.Counter({"mosaic:fp8_blockwise_gemm_wgmma": 1})
    assert launches(_cuda(lambda x, w: f(x, w, dn), S((17, 256), jnp.bfloat16), S((384, 256), jnp.bfloat16))) == \
        collections.Counter({"mosaic:fp8_decode_gemm_swapab_wgmma": 1})


def _train_grad(grad):
    f = training.make_fp8_train_dot_general(grad)
    dn = (((1,), (1,)), ((), ()))  # the project's Linear: x [M, K] . w [N, K]
    return jax.grad(lambda x, w: jnp.sum(f(x, w, dn).astype(jnp.float32) ** 2), argnums=(0, 1))


def test_fp8_training_e4m3_runs_all_three_gemms_on_mosaic_e5m2_only_the_forward():
    """FP8 training forward + backward lowered for CUDA at M = 300 tokens: with ``grad="e4m3"`` three Mosaic GEMMs
    (forward and input gradient 1D2D, weight gradient 1D1D), every operand e4m3, no Triton kernel; with
    ``grad="e5m2"`` only the forward is a Mosaic GEMM and the two gradient GEMMs are XLA FP8 dots with e5m2 x e4m3
    operands (Mosaic GPU's wgmma takes one element type)."""
    args = (S((300, 256), jnp.bfloat16), S((384, 256), jnp.bfloat16))
    hlo = _cuda(_train_grad("e4m3"), *args)
    assert launches(hlo) == collections.Counter({"mosaic:fp8_blockwise_gemm_wgmma": 2,
                                                 "mosaic:fp8_blockwise_gemm_wgmma_1d1d": 1}), launches(hlo)
    types = mosaic_operand_types(hlo)
    assert len(types) == 3 and all(t.count("f8E4M3FN") == 2 for t in types), types
    # the weight gradient contracts over the 300 tokens (padded to 384): both operands K-major [rows, tokens]
    assert any(t.startswith("tensor<384x384xf8E4M3FN>") and "tensor<256x384xf8E4M3FN>" in t for t in types), types
    hlo = _cuda(_train_grad("e5m2"), *args)
    assert launches(hlo) == collections.Counter({"mosaic:fp8_blockwise_gemm_wgmma": 1}), launches(hlo)
    assert re.search(r"stablehlo\.dot_general .*f8E5M2.*f8E4M3FN", hlo)


def _moe_block(*, precision="fp8", e=4, seed=0):
    from flax import nnx

    from fp8rl_jax.models.moe import SparseMoeBlock, tiny_qwen3_moe_config

    cfg = tiny_qwen3_moe_config(64, hidden_size=256, moe_intermediate_size=128, num_experts=e, num_experts_per_tok=2)
    return cfg, SparseMoeBlock(cfg, linear_precision=precision, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16,
                               rngs=nnx.Rngs(seed))


def test_moe_experts_lower_to_mosaic_for_prefill_and_swapab_for_decode():
    """FP8 experts ("auto") lowered for CUDA: 128 tokens x top-2 = 256 routed rows over 4 experts (padding bound
    4 x 63 = 252 <= 256) take three Mosaic grouped GEMMs on 64-row tiles (gate, up, down); 8 tokens take the
    grouped swap-AB Mosaic decode GEMM (three launches, e4m3 x e4m3 operands); both quantize their two inputs (the
    routed rows, the SwiGLU output) with the ``quant`` family's kernel and run no other Triton kernel; with
    ``fp8_expert_impl="pallas"`` the Triton grouped kernel, which quantizes inside."""
    from flax import nnx

    from fp8rl_jax.models.moe import grouped_expert_kernel

    assert grouped_expert_kernel(256, 4) == 64 and grouped_expert_kernel(16, 4) is None
    assert grouped_expert_kernel(8064, 128) == 64 and grouped_expert_kernel(8063, 128) is None
    assert grouped_expert_kernel(128 * 127, 128) == 128
    cfg, blk = _moe_block()
    graph, state = nnx.split(blk)
    st = jax.tree.map(lambda a: S(a.shape, a.dtype), state)

    def fwd(s, x):
        return nnx.merge(graph, s).forward(x)[0]

    hlo = _cuda(fwd, st, S((128, cfg.hidden_size), jnp.bfloat16))
    assert launches(hlo) == collections.Counter({"mosaic:fp8_blockwise_grouped_gemm_wgmma": 3,
                                                 "triton:fp8_blockwise_quant": 2}), launches(hlo)
    assert all(t.count("f8E4M3FN") == 2 for t in mosaic_operand_types(hlo))
    hlo = _cuda(fwd, st, S((8, cfg.hidden_size), jnp.bfloat16))
    assert launches(hlo) == collections.Counter({"mosaic:fp8_grouped_decode_gemm_swapab_wgmma": 3,
                                                 "triton:fp8_blockwise_quant": 2}), launches(hlo)
    assert all(t.count("f8E4M3FN") == 2 for t in mosaic_operand_types(hlo))
    blk.fp8_expert_impl = "pallas"
    graph, state = nnx.split(blk)

    def fwd_triton(s, x):
        return nnx.merge(graph, s).forward(x)[0]

    hlo = _cuda(fwd_triton, st, S((8, cfg.hidden_size), jnp.bfloat16))
    assert launches(hlo) == collections.Counter({"triton:fp8_w8a8_grouped_gemm": 3}), launches(hlo)


def test_moe_fp8_training_tiles_are_whole_warpgroups_on_cuda_only():
    """FP8 training (``grad="e4m3"``) on the experts with 8-row tiles: lowered for CUDA the tile edge becomes 64 (5
    tiles for 80 routed rows over 4 experts instead of 13 of 8 rows, each of which the GEMM would pad to 64), and
    every product of the parameter gradient is a batched Mosaic GEMM (one weight per tile); lowered for the CPU the
    program holds no kernel."""
    from flax import nnx

    cfg, blk = _moe_block(precision="dense")
    dgen = training.make_fp8_train_dot_general("e4m3")
    for lin in (blk.experts.gate_proj, blk.experts.up_proj, blk.experts.down_proj):
        lin.dot_general = dgen
    blk.tile_rows = 8
    graph, state = nnx.split(blk)
    st = jax.tree.map(lambda a: S(a.shape, a.dtype), state)

    def loss(s, x):
        return jnp.sum(nnx.merge(graph, s)(x).astype(jnp.float32) ** 2)

    x = S((40, cfg.hidden_size), jnp.bfloat16)
    hlo = _cuda(jax.grad(loss), st, x)
    n = launches(hlo)
    # forward of gate, up, down; the input gradient of down only (the block's input is not differentiated); the
    # three weight gradients (1D1D)
    assert n == collections.Counter({"mosaic:fp8_blockwise_grouped_gemm_wgmma": 4,
                                     "mosaic:fp8_blockwise_grouped_gemm_wgmma_1d1d": 3}), n
    from fp8rl_jax.models.grouped import num_tiles

    # each batched GEMM runs one weight per tile: its tile_group operand has one entry per tile, G = num_tiles(., 64)
    tiles = [int(re.search(r"tensor<(\d+)xi32>$", t).group(1)) for t in mosaic_operand_types(hlo)]
    assert tiles and set(tiles) == {num_tiles(40 * 2, cfg.num_experts, 64)}, tiles  # per distinct call site
    cpu = jax.jit(jax.grad(loss)).trace(st, x).lower(lowering_platforms=("cpu",)).as_text()
    assert "mosaic_gpu" not in cpu and "triton" not in cpu


# ----------------------------------------------------------------------------------------------------------------
# (c) deviceless sm_90a compile in .venv-cuda

_COMPILE = textwrap.dedent("""
    import dataclasses, json, os, re, sys, time
    import jax, jax.numpy as jnp
    from flax import nnx
    from fp8rl_jax import gpu_target as gt
    from fp8rl_jax.fp8 import linear, training
    from fp8rl_jax.models.moe import SparseMoeBlock, tiny_qwen3_moe_config

    S = jax.ShapeDtypeStruct
    out_dir = sys.argv[1]
    res = {}

    def wide_float_writers(dump_dir, min_elems):
        # (name, op) of the entry computation's instructions that write a float array of >= min_elems elements
        hlo = max((os.path.join(dump_dir, f) for f in os.listdir(dump_dir)
                   if f.endswith("gpu_after_optimizations.txt")), key=os.path.getsize)
        text = open(hlo).read()
        entry = text[text.index("ENTRY"):]
        entry = entry[:entry.index("\\n}")]
        found = []
        for m in re.finditer(r"%([\\w.\\-]+) = (\\(?[^=]*?\\)?) (\\w[\\w-]*)\\(", entry):
            for dt, dims in re.findall(r"\\b(bf16|f16|f32)\\[([\\d,]*)\\]", m.group(2)):
                n = 1
                for d in filter(None, dims.split(",")):
                    n *= int(d)
                if n >= min_elems and m.group(3) not in ("parameter", "bitcast", "tuple", "get-tuple-element"):
                    tgt = re.search(r'custom_call_target="([^"]+)"', entry[m.start():entry.find("\\n", m.start())])
                    found.append((m.group(1), m.group(3), tgt.group(1) if tgt else ""))
        return found

    def run(name, fn, *args, min_elems=None):
        d = os.path.join(out_dir, name)
        t = time.perf_counter()
        r = gt.compile_for_h100(fn, *args, dump_dir=d)
        res[name] = {"compile_s": round(time.perf_counter() - t, 1), "forms": r.gemm_instruction_counts,
                     "kernels": r.pallas_kernels, "spills": r.spills, "notes": r.notes,
                     "wide": wide_float_writers(d, min_elems) if min_elems else None}

    # an FP8 linear of the engine at Qwen3-8B shapes (q_proj / o_proj), M = 4096
    run("linear_M4096", lambda x, w, s: linear.w8a8_block_matmul(x, w, s), S((4096, 4096), jnp.bfloat16),
        S((4096, 4096), jnp.float8_e4m3fn), S((32, 32), jnp.float32), min_elems=4096 * 4096)
    # Qwen3-30B-A3B experts (hidden 2048, moe_intermediate 768, 128 experts, top-8), a 1024-token prefill
    cfg = tiny_qwen3_moe_config(151936, hidden_size=2048, num_experts=128, num_experts_per_tok=8,
                                moe_intermediate_size=768)
    blk = nnx.eval_shape(lambda: SparseMoeBlock(cfg, linear_precision="fp8", param_dtype=jnp.bfloat16,
                                                dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    graph, state = nnx.split(blk)
    run("moe_30b_a3b_1024_tokens", lambda s, x: nnx.merge(graph, s).forward(x)[0],
        jax.tree.map(lambda a: S(a.shape, a.dtype), state), S((1024, 2048), jnp.bfloat16))
    # FP8 training step of the Qwen3-8B gate_proj (N = 12288, K = 4096) on 2048 tokens, e4m3 backward
    f = training.make_fp8_train_dot_general("e4m3")
    dn = (((1,), (1,)), ((), ()))
    run("train_e4m3_M2048", jax.grad(lambda x, w: jnp.sum(f(x, w, dn).astype(jnp.float32) ** 2), argnums=(0, 1)),
        S((2048, 4096), jnp.bfloat16), S((12288, 4096), jnp.bfloat16), min_elems=2048 * 4096)
    print(json.dumps(res))
""")

WGMMA_E4M3 = re.compile(r"^wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.f32\.e4m3\.e4m3$")


@pytest.fixture(scope="module")
def sm90a(tmp_path_factory):
    """The three programs of (c) compiled for sm_90a in one .venv-cuda process: ``{name: result}``."""
    from conftest import require_cuda_venv

    cuda_py = require_cuda_venv()
    out = tmp_path_factory.mktemp("wgmma_sm90a")
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1"}
    for var in ("JAX_PLATFORMS", "XLA_FLAGS", "MOSAIC_GPU_DUMP_TO", "JAX_COMPILATION_CACHE_DIR"):
        env.pop(var, None)
    t = time.perf_counter()
    proc = subprocess.run([cuda_py, "-c", _COMPILE, str(out)], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"sm_90a compiles ({time.perf_counter() - t:.1f} s with the process):")
    for name, r in res.items():
        print(f"  {name}: {r['compile_s']} s, {r['forms']}, kernels {r['kernels']}")
    return res


@pytest.mark.parametrize("name", ["linear_M4096", "moe_30b_a3b_1024_tokens", "train_e4m3_M2048"])
def test_sm90a_ptx_fp8_wgmma_no_f16_mma(sm90a, name):
    """The GEMMs of each program are FP8 wgmma with e4m3 operands (float32 accumulator); no f16 ``mma.sync`` (what
    Pallas-Triton makes of e4m3). The only other GEMM allowed is the MoE router's dense bf16 ``mma.sync`` (the router
    stays unquantized, as in vLLM); the Mosaic kernels spill nothing."""
    r = sm90a[name]
    forms = set(r["forms"])
    wgmma = {f for f in forms if f.startswith("wgmma")}
    assert wgmma and all(WGMMA_E4M3.match(f) for f in wgmma), forms
    assert not any(".f16.f16" in f for f in forms), forms
    others = forms - wgmma
    assert others <= ({"mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"} if name.startswith("moe") else set()), \
        forms
    mosaic = {k: v for k, v in (r["spills"] or {}).items() if "wgmma" in k}
    assert mosaic and all(v["spill_stores"] == 0 for v in mosaic.values()), r["spills"]


def test_sm90a_training_and_linear_write_no_wide_float_copies(sm90a):
    """In the compiled programs the only instructions that write float arrays as large as an operand are the
    Mosaic GEMMs (and, for training, the loss's own cotangent fused into the quantizers): no transposed or
    re-laid-out float copy of the activations, the weight or the gradient; the weight gradient's operands are
    transposed as e4m3 bytes inside the quantizing fusions."""
    for name in ("linear_M4096", "train_e4m3_M2048"):
        wide = sm90a[name]["wide"]
        assert wide and all(op == "custom-call" and tgt.startswith("mosaic_gpu") for _, op, tgt in wide), (name, wide)


# ----------------------------------------------------------------------------------------------------------------
# On a CUDA GPU (skipped without one): the self-test passes there and the "auto" programs run the chosen kernels

#: Relative Frobenius error allowed against the float64 formula on Hopper: the FP8 wgmma sums a 128-wide K block's
#: products with ~14 significant bits (DeepSeek-V3 Sec. 3.3.2), ~sqrt(128) * 2**-14 ~ 7e-4 relative; vLLM's block-FP8
#: GEMM test bounds the mean relative difference by 1e-3 (tests/test_fp8_gpu.py's GEMM_RTOL)
GPU_RTOL = 1e-3
#: Bound for the MoE block end to end (gate/up GEMMs, SwiGLU, *requantization* of the intermediate to e4m3 1x128
#: groups, down GEMM, top-k combine) against the float64 reference that requantizes its own float64 intermediate.
#: Derivation (issue 36, item 2): the gate/up GEMMs carry the dense GEMM's relative error ``eps = GPU_RTOL`` (FP8
#: wgmma's ~14-bit partial sums per 128-wide K block; test_fp8_gpu.GEMM_RTOL). The requantization divides each value
#: ``h`` by its group's scale ``amax / 448``, and both ``h`` and the group's ``amax`` carry that error, so the quotient
#: moves by ``delta <= 2 eps |h|`` relative to the reference's; that turns into a flip to the neighbouring e4m3 code whenever a rounding
#: boundary lies between ``h`` and ``h + delta``: probability ``delta / q`` for the local e4m3 step ``q``, and a flip
#: moves the value by ``q``. Over the intermediate, the expected squared change is ``sum (delta / q) q^2 = sum delta q
#: <= 2 eps * u * sum h^2`` with ``u = 2**-3`` e4m3's largest step relative to the value (3 mantissa bits), so the
#: requantized intermediate moves by a relative RMS of at most ``sqrt(2 eps u)`` *in expectation*; the down GEMM carries
#: that into the output (plus its own ``eps``). A realization is a sum over a few flips (about ``N * eps / u`` of them,
#: Poisson-like), whose norm exceeds its RMS by up to ~2x at the flip counts of a test-sized block; hence
#: ``eps + 2 sqrt(2 eps 2**-3)`` ~ 3.3e-2. A defect (a group's rows in another
#: group's tile, a wrong scale index, a tile edge) moves whole rows by O(1): with 1 row in 256 wrong the error is
#: already ~6e-2. The dense GEMM keeps ``GPU_RTOL``: it has no requantization inside. The mechanism is checked on the
#: CPU (test_requantization_amplifies_gemm_error_within_the_moe_bound).
MOE_GPU_RTOL = GPU_RTOL + 2 * (2 * GPU_RTOL * 2.0 ** -3) ** 0.5
needs_gpu = pytest.mark.skipif(registry.cuda_device() is None, reason="needs a CUDA GPU (none on this machine)")


def _rel(got, want):
    return float(np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want))


def test_requantization_amplifies_gemm_error_within_the_moe_bound():
    """Issue 36 (2), the mechanism behind :data:`MOE_GPU_RTOL` in float64 numpy: perturb an intermediate ``h`` (the
    SwiGLU output of 128 tokens x 128 features) by a relative error ``eps`` (as the gate/up GEMM on FP8 tensor cores
    does), requantize both to e4m3 1x128 groups, and push both through the same down projection. The output's
    relative error exceeds ``eps`` itself (flips are whole e4m3 steps: the dense GEMM's bound cannot hold for the
    chain); its mean over 8 draws stays within ``eps + sqrt(2 eps 2**-3)`` and every draw within
    ``eps + 2 sqrt(2 eps 2**-3)``, at every ``eps`` from 1e-5 to 1e-3."""
    rng = np.random.default_rng(0)
    h = rng.standard_normal((128, 128)) * np.exp(rng.uniform(-2, 2, (128, 1)))
    wd = rng.standard_normal((256, 128)) * 0.05

    def requant(v):
        q, sc = ref.quantize_blocks(v.astype(np.float32), 1, 128, formats.ACTIVATION_RECIPE)
        return ref.dequantize_blocks(q, sc, 1, 128)

    want = requant(h) @ wd.T
    for eps in (1e-5, 1e-4, 1e-3):
        errs = []
        for seed in range(8):
            noise = np.random.default_rng(100 + seed).standard_normal(h.shape) * eps
            got = requant(h * (1 + noise)) @ wd.T
            errs.append(np.linalg.norm(got - want) / np.linalg.norm(want))
        assert np.mean(errs) < eps + (2 * eps * 2.0 ** -3) ** 0.5, (eps, errs)
        assert max(errs) < eps + 2 * (2 * eps * 2.0 ** -3) ** 0.5, (eps, errs)
        assert np.mean(errs) > eps, (eps, errs)  # the chain amplifies: a GEMM-only bound is too tight


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("m", [1, 100, 128, 4096])
def test_on_gpu_linear_auto_runs_the_chosen_kernel_and_matches_float64(m):
    """On the GPU: the ``w8a8_gemm`` (Mosaic), ``decode_gemm`` and ``quant`` self-tests pass; the engine's FP8 linear
    quantizes its input with the ``quant`` kernel and runs the decode kernel at M = 1 and the Mosaic GEMM at
    M = 100, 128, 4096, within :data:`GPU_RTOL` of the float64 formula."""
    assert all(registry.selftest_passed(f) for f in ("w8a8_gemm", "decode_gemm", "quant")), \
        registry.selftest_failures()
    dev = registry.cuda_device()
    x, wq, ws = _linear_case(m, 640, 1024, seed=m)
    args = [jax.device_put(a, dev) for a in (x, wq, ws)]
    f = jax.jit(lambda *a: linear.w8a8_block_matmul(*a, out_dtype=jnp.float32))
    hlo = f.lower(*args).as_text()
    # the swap-AB decode kernel or the Mosaic GEMM, and the activation quantization kernel, no other
    gemm = "mosaic:fp8_decode_gemm_swapab_wgmma" if m <= 64 else "mosaic:fp8_blockwise_gemm_wgmma"
    quant = "triton:fp8_decode_operand_quant" if m <= 64 else "triton:fp8_blockwise_quant"
    assert launches(hlo) == collections.Counter({quant: 1, gemm: 1}), launches(hlo)
    y = f(*args)
    assert y.devices() == {dev}
    assert _rel(y, _f64_linear(x, wq, ws)[0]) < GPU_RTOL


@pytest.mark.gpu
@needs_gpu
def test_on_gpu_fp8_training_e4m3_runs_three_mosaic_gemms_and_matches_float64():
    """On the GPU: FP8 training with ``grad="e4m3"`` at M = 512 tokens runs forward, input and weight gradient on
    the Mosaic kernel; each within :data:`GPU_RTOL` of the float64 formulas (tests/test_fp8_training.py)."""
    from test_fp8_training import DN_NK, _e4m3_reference

    dev = registry.cuda_device()
    rng = np.random.default_rng(5)
    x = rng.standard_normal((512, 1024)).astype(np.float32)
    w = (rng.standard_normal((640, 1024)) * 0.03).astype(np.float32)
    g = rng.standard_normal((512, 640)).astype(np.float32)
    f = training.make_fp8_train_dot_general("e4m3")

    def fwd_bwd(a, b, c):
        y, vjp = jax.vjp(lambda u, v: f(u, v, DN_NK), a, b)
        return (y, *vjp(c))

    args = [jax.device_put(a, dev) for a in (x, w, g)]
    hlo = jax.jit(fwd_bwd).lower(*args).as_text()
    assert launches(hlo) == collections.Counter({"mosaic:fp8_blockwise_gemm_wgmma": 2,
                                                 "mosaic:fp8_blockwise_gemm_wgmma_1d1d": 1}), launches(hlo)
    want = _e4m3_reference(x, w, g)
    for name, got in zip(("y", "dx", "dw"), jax.jit(fwd_bwd)(*args)):
        assert _rel(got, want[name][0]) < GPU_RTOL, name


@pytest.mark.gpu
@needs_gpu
def test_on_gpu_moe_prefill_runs_the_mosaic_experts_and_matches_float64():
    """On the GPU: FP8 experts ("auto") for 128 tokens x top-2 over 4 experts (Mosaic grouped GEMMs on 64-row tiles)
    equal the float64 per-token reference (tests/test_stacked_experts.py) within :data:`MOE_GPU_RTOL` (the chained
    requantization's bound; 2.6e-3 was measured on an H200 against the dense 1e-3 that does not apply here)."""
    from flax import nnx

    from fp8rl_jax.models.moe import SparseMoeBlock, tiny_qwen3_moe_config
    from test_stacked_experts import _reference

    dev = registry.cuda_device()
    cfg = tiny_qwen3_moe_config(64, hidden_size=256, moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2)
    rng = np.random.default_rng(6)
    with jax.default_device(dev):
        blk = SparseMoeBlock(cfg, linear_precision="fp8", param_dtype=jnp.float32, dtype=jnp.float32,
                             rngs=nnx.Rngs(0))
        router = (rng.normal(size=(4, 256)) * 0.5).astype(np.float32)
        blk.gate.weight[...] = jnp.asarray(router)
        w64 = {}
        for name in ("gate_proj", "up_proj", "down_proj"):
            lin = getattr(blk.experts, name)
            w = (rng.normal(size=lin.weight.shape) * 0.05).astype(np.float32)
            q, s = ref.quantize_blocks(w, 128, 128, formats.WEIGHT_RECIPE)
            lin.weight[...], lin.weight_scale_inv[...] = jnp.asarray(q), jnp.asarray(s)
            w64[name] = ref.dequantize_blocks(q, s, 128, 128)
        x = rng.normal(size=(128, 256)).astype(np.float32)
        graph, state = nnx.split(blk)
        f = jax.jit(lambda st, v: nnx.merge(graph, st).forward(v)[0])
        hlo = f.lower(state, jnp.asarray(x)).as_text()
        assert launches(hlo) == collections.Counter({"mosaic:fp8_blockwise_grouped_gemm_wgmma": 3,
                                                 "triton:fp8_blockwise_quant": 2}), launches(hlo)
        out = f(state, jnp.asarray(x))

    def act_q(v):
        q, s = ref.quantize_blocks(np.asarray(v, np.float32), 1, 128, formats.ACTIVATION_RECIPE)
        return ref.dequantize_blocks(q, s, 1, 128)

    want, _ = _reference(x.astype(np.float64), router.astype(np.float64), w64["gate_proj"], w64["up_proj"],
                         w64["down_proj"], 2, act_q)
    assert _rel(out, want) < MOE_GPU_RTOL
