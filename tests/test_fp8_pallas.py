"""The Pallas quantization kernels equal the jnp reference bit for bit (interpret mode on CPU) and lower to
exact Triton IR for CUDA (checked without a GPU)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8rl_jax.fp8 import formats, quant
from fp8rl_jax.kernels.pallas_gemm import pallas_w8a8_matmul
from fp8rl_jax.kernels.pallas_quant import pallas_quantize_activation_groupwise, pallas_quantize_weight_blockwise
from fp8rl_jax.gpu_target import lowering_for_h100
from fp8_problems import assert_same_quant as _same
from fp8_problems import QUANT_RECIPES as RECIPES
from fp8_problems import quant_test_data

def _data(shape, seed, dtype=jnp.float32):
    return jnp.asarray(quant_test_data(shape, seed)).astype(dtype)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.name.split()[0])
@pytest.mark.parametrize("ue8m0", [False, True])
def test_weight_kernel_bit_exact(recipe, ue8m0):
    # a stack of 3 layers, ragged in both dims (one call quantizes all three)
    x = _data((3, 129, 257), seed=1, dtype=jnp.bfloat16)
    _same(pallas_quantize_weight_blockwise(x, 128, ue8m0, recipe=recipe, interpret=True),
          quant.quantize_weight_blockwise(x, 128, ue8m0, recipe=recipe))


@pytest.mark.parametrize("shape", [(1, 1), (64, 128), (2, 3, 200)])
@pytest.mark.parametrize("ue8m0", [False, True])
def test_activation_kernel_bit_exact(shape, ue8m0):
    x = _data(shape, seed=2)
    for recipe in (formats.VLLM_GROUP_NATIVE, formats.VLLM_GROUP_TRITON):
        _same(pallas_quantize_activation_groupwise(x, 128, ue8m0, recipe=recipe, block_rows=8, interpret=True),
              quant.quantize_activation_groupwise(x, 128, ue8m0, recipe=recipe))


@pytest.mark.parametrize("m,k", [(1, 4096), (5, 300), (20, 256), (33, 384), (64, 128)])
def test_decode_operand_quantizer_writes_the_decode_kernels_layout(m, k):
    """``quantize_activation_for_decode`` (the swap-AB decode GEMM's input, issue 37 item 1), in interpret mode:
    the e4m3 values and scales of the independent numpy quantizer (1x128 groups, vLLM QuantFP8 native rounding),
    laid out as the kernel reads them: rows zero-padded to m_pad (8, 24, 40: Triton blocks of a power of two
    rows), K to whole groups, the scales transposed; a padded row's scale is the zero row's (floored amax / 448),
    and every zero value dequantizes to zero. The portable path gives the same bits."""
    import fp8_numpy_ref as ref
    from fp8rl_jax.kernels.decode_gemm_mgpu import padded_tokens
    from fp8rl_jax.kernels.pallas_quant import quantize_activation_for_decode

    rng = np.random.default_rng(m)
    x64 = rng.standard_normal((m, k)) * np.logspace(-3, 2, k)
    x = jnp.asarray(x64, jnp.bfloat16)
    m_pad, kb = padded_tokens(m), -(-k // 128)
    q, st = quantize_activation_for_decode(x, m_pad, interpret=True)
    assert q.shape == (m_pad, kb * 128) and q.dtype == jnp.float8_e4m3fn and st.shape == (kb, m_pad)
    rq, rs = ref.quantize_blocks(np.asarray(x, np.float32), 1, 128, formats.ACTIVATION_RECIPE)
    zq, zs = ref.quantize_blocks(np.zeros((1, 128), np.float32), 1, 128, formats.ACTIVATION_RECIPE)
    want_q = np.zeros((m_pad, kb * 128), np.uint8)
    want_q[:m, :k] = np.asarray(rq).view(np.uint8)
    want_s = np.concatenate([rs, np.broadcast_to(zs, (m_pad - m, kb))], axis=0).T
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), want_q)
    np.testing.assert_array_equal(np.asarray(st), want_s)
    pq, ps = quantize_activation_for_decode(x, m_pad, cuda=False)
    np.testing.assert_array_equal(np.asarray(pq).view(np.uint8), want_q)
    np.testing.assert_array_equal(np.asarray(ps), want_s)
    with pytest.raises(ValueError, match="m_pad must be a multiple of 8"):
        quantize_activation_for_decode(x, m_pad + 4, interpret=True)


def test_kernel_zero_blocks_and_nonfinite():
    x = jnp.zeros((256, 256), jnp.float32).at[200, 200].set(7.0)
    _same(pallas_quantize_weight_blockwise(x, interpret=True), quant.quantize_weight_blockwise(x))
    with pytest.raises(ValueError, match="NaN or inf"):
        pallas_quantize_weight_blockwise(x.at[3, 3].set(jnp.nan), interpret=True)
    with pytest.raises(ValueError, match="NaN or inf"):
        pallas_quantize_activation_groupwise(x.at[3, 3].set(-jnp.inf), interpret=True)


def test_kernels_follow_the_platform_lowered_for_not_the_devices_present():
    """Issue 28 (1): the same "auto" dispatchers lower to the Pallas kernels for CUDA and to the jnp/XLA paths for the
    CPU, in one process whose only devices are CPUs (no monkeypatching): the choice is per computation, made by
    ``jax.lax.platform_dependent`` when the program is lowered. On a GPU host a CPU-placed computation thus never
    gets a compiled (non-interpret) Pallas kernel, which the CPU backend rejects."""
    from fp8rl_jax.fp8 import linear
    from fp8rl_jax.kernels import pallas_quant

    e4m3 = jnp.float8_e4m3fn
    progs = {
        "quant": (lambda ws: pallas_quant.quantize_weights_batched(ws, check=False),
                  ({"a": S((256, 256), jnp.bfloat16)},)),
        "w8a8": (lambda x, w, s: linear.w8a8_block_matmul(x, w, s),
                 (S((200, 256), jnp.bfloat16), S((256, 256), e4m3), S((2, 2), jnp.float32))),
        "decode": (lambda x, w, s: linear.w8a8_block_matmul(x, w, s),
                   (S((4, 256), jnp.bfloat16), S((256, 256), e4m3), S((2, 2), jnp.float32))),
    }
    for name, (fn, args) in progs.items():
        cpu = jax.jit(fn).trace(*args).lower(lowering_platforms=("cpu",)).as_text()
        assert "triton" not in cpu and "mosaic_gpu" not in cpu, name
        hlo, kernels = _lower_for_cuda(fn, *args)
        if name == "w8a8":  # M = 200: the Mosaic GPU wgmma GEMM (fp8rl_jax.fp8.dot_general.cuda_gemm_impl)
            assert "stablehlo.custom_call @mosaic_gpu" in hlo, name
        elif name == "decode":  # M = 4: the swap-AB Mosaic GPU decode GEMM (issue 37)
            assert "stablehlo.custom_call @mosaic_gpu" in hlo and "fp8_decode_gemm_swapab_wgmma" in hlo, name
        else:
            assert kernels, f"{name}: no Triton kernel when lowered for CUDA"
    # computed here (a CPU): the jnp path, equal to the reference
    w = _data((256, 256), seed=5, dtype=jnp.bfloat16)
    _same(pallas_quant.quantize_weights_batched([w])[0], quant.quantize_weight_blockwise(w))


# --------------------------------------------------------------------------------------------------------
# GPU lowering, checked on any machine: the kernels are lowered for CUDA (sm_90) and the Triton IR they
# produce is read back. What runs on a Hopper GPU is this IR compiled by Triton; compiling it and timing it
# need a GPU (benchmarks/bench_quant.py, bench_fp8_matmul.py).

S = jax.ShapeDtypeStruct


def _lower_for_cuda(fn, *args):
    """``(stablehlo text, [Triton module text per pallas_call])`` of ``jit(fn)`` lowered for CUDA.

    Uses JAX's cross-platform lowering (``lowering_platforms=("cuda",)``, which needs no GPU); each Pallas
    kernel is a ``__gpu$xla.gpu.triton`` custom call whose backend config holds the Triton module as MLIR
    bytecode, parsed back here with jaxlib's Triton dialect. Public APIs only (jax's ``trace().lower()``, the
    ``jaxlib.mlir`` / ``jaxlib.triton`` packages), so it runs on jax 0.10.x and 0.11.x alike.
    """
    # jaxlib's own MLIR bindings and Triton dialect (the jaxlib package, not jax's private jax._src)
    from jaxlib.mlir import ir
    from jaxlib.triton import dialect as tt_dialect

    with lowering_for_h100():  # an abstract H100 (jax 0.11's Triton lowering reads the GPU from it)
        module = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).compiler_ir("stablehlo")
    calls = []

    def walk(op):
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    if inner.operation.name == "stablehlo.custom_call":
                        calls.append(inner.operation)
                    walk(inner.operation)

    walk(module.operation)
    kernels = []
    for call in calls:
        if "triton" not in ir.StringAttr(call.attributes["call_target_name"]).value:
            continue
        raw = ir.StringAttr(ir.DictAttr(call.attributes["mhlo.backend_config"])["ir"]).value_bytes
        with ir.Context() as ctx:
            tt_dialect.register_dialect(ctx)
            kernels.append(str(ir.Module.parse(raw)))
    return str(module), kernels


def _assert_exact_quant_ir(ir_text, *, divisions):
    # Triton's float '/' is the approximate div.full.f32: every division must be the PTX div.rn.f32 asm.
    assert "arith.divf" not in ir_text
    assert ir_text.count('"div.rn.f32 $0, $1, $2;"') == divisions
    # NaN is mapped to +inf before the NaN-ignoring maxnumf reductions (so a NaN block gets an inf scale).
    assert "arith.cmpf une" in ir_text and "arith.maxnumf" in ir_text
    # The e4m3 cast is Triton's round-to-nearest-even convert (cvt.rn.satfinite.e4m3x2.f32 on sm_90).
    assert re.search(r"tt\.fp_to_fp %\w+, rounding = rtne : tensor<\d+x\d+xf32> -> tensor<\d+x\d+xf8E4M3FN>",
                     ir_text)
    assert "log2" not in ir_text  # UE8M0 is integer bit arithmetic, not an approximate log2


@pytest.mark.parametrize("ue8m0", [False, True])
def test_weight_kernel_lowers_to_triton_for_cuda(ue8m0):
    """One pallas_call for a whole [L, N, K] stack, grid (L, N/128, K/128), exact-division Triton IR."""
    hlo, kernels = _lower_for_cuda(
        lambda w: pallas_quantize_weight_blockwise(w, 128, ue8m0, interpret=False, check=False),
        S((3, 256, 384), jnp.bfloat16))
    assert len(kernels) == 1 and hlo.count("__gpu$xla.gpu.triton") == 1
    assert "grid_x = 3 : i32, grid_y = 2 : i32, grid_z = 3 : i32" in hlo
    # VLLM_BLOCK_CAST: s = max(amax, 1e-4) / 448 and one reciprocal 1 / s per block.
    _assert_exact_quant_ir(kernels[0], divisions=2)
    assert "tensor<128x128xbf16>" in kernels[0]


@pytest.mark.parametrize("recipe,divisions", [(formats.VLLM_GROUP_NATIVE, 2), (formats.VLLM_GROUP_TRITON, 1)],
                         ids=["native", "triton"])
def test_activation_kernel_lowers_to_triton_for_cuda(recipe, divisions):
    """1 x 128 groups: native = amax / 448 then x / s; Triton recipe = amax * fp32(1/448) then x / s."""
    _, kernels = _lower_for_cuda(
        lambda x: pallas_quantize_activation_groupwise(x, 128, recipe=recipe, interpret=False, check=False),
        S((64, 512), jnp.bfloat16))
    assert len(kernels) == 1
    _assert_exact_quant_ir(kernels[0], divisions=divisions)


@pytest.mark.parametrize("bm,warps,stages", [(None, 4, 3), (128, 8, 4)])  # default tile; a bench_fp8_matmul tile
def test_w8a8_gemm_lowers_to_fp8_tt_dot_for_cuda(bm, warps, stages):
    """The fused GEMM is a K loop of e4m3 x e4m3 -> f32 tt.dot (Hopper FP8 tensor cores), scales in f32."""
    e4m3 = jnp.float8_e4m3fn
    hlo, kernels = _lower_for_cuda(
        lambda xq, xs, wq, ws: pallas_w8a8_matmul(xq, xs, wq, ws, bm=bm, num_warps=warps, num_stages=stages,
                                                  interpret=False),
        S((256, 512), e4m3), S((256, 4), jnp.float32), S((256, 512), e4m3), S((2, 4), jnp.float32))
    assert len(kernels) == 1
    assert f"num_stages = {stages} : i32, num_warps = {warps} : i32" in hlo
    ir_text = kernels[0]
    assert "scf.for" in ir_text
    dots = re.findall(r"tt\.dot .*: tensor<(\d+)x128xf8E4M3FN> \* tensor<128x(\d+)xf8E4M3FN> -> tensor<\d+x\d+xf32>",
                      ir_text)
    assert dots == [(str(bm or 64), "128")]


def test_fp8_linear_lowers_to_real_fp8_ops_for_cuda():
    """An ``nnx.Linear`` with the FP8 dot_general, lowered for CUDA: impl="pallas" runs the Triton FP8 GEMM;
    impl="blocked" hands XLA a dot_general on e4m3 operands with an f32 result (cuBLASLt FP8 on Hopper)."""
    from flax import nnx

    from fp8rl_jax.fp8 import dot_general as dg

    x = S((64, 256), jnp.bfloat16)
    for impl in ("pallas", "blocked"):
        layer = nnx.Linear(256, 384, dot_general=dg.make_fp8_dot_general(impl=impl), dtype=jnp.bfloat16,
                           param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
        graph, state = nnx.split(layer)
        hlo, kernels = _lower_for_cuda(lambda st, xx: nnx.merge(graph, st)(xx), state, x)
        if impl == "pallas":
            assert len(kernels) == 1 and "tt.dot" in kernels[0] and "xf8E4M3FN>" in kernels[0]
        else:
            assert not kernels
            assert re.search(r"stablehlo\.dot_general .*tensor<[\dx]+xf8E4M3FN>, tensor<[\dx]+xf8E4M3FN>\) -> "
                             r"tensor<[\dx]+xf32>", hlo)


def test_batched_export_is_one_triton_launch_per_weight_shape_on_cuda():
    """quantize_weights_batched on a GPU: 2 layers x {q, k, v, o} (3 distinct shapes) -> 3 Triton launches."""
    from fp8rl_jax.kernels import pallas_quant

    shapes = {"q_proj": (512, 256), "k_proj": (128, 256), "v_proj": (128, 256), "o_proj": (256, 512)}
    weights = {f"layers.{i}.{n}": S(s, jnp.bfloat16) for i in range(2) for n, s in shapes.items()}
    hlo, kernels = _lower_for_cuda(lambda ws: pallas_quant.quantize_weights_batched(ws, check=False), weights)
    assert len(kernels) == 3 and hlo.count("__gpu$xla.gpu.triton") == 3
    for text in kernels:
        _assert_exact_quant_ir(text, divisions=2)


@pytest.mark.parametrize("shape,block", [((2, 129, 257), (128, 128)), ((1, 257, 896), (32, 128)),
                                         ((3, 200, 130), (128, 128))])
def test_no_quant_tile_overhangs_its_arrays_on_cuda(shape, block):
    """Pallas' Triton lowering does not mask plain ref loads/stores, so every tile must lie inside its arrays:
    ragged inputs are zero-padded to whole tiles and the custom call's operand is exactly grid x block."""
    from fp8rl_jax.kernels.pallas_quant import padded_tile_shape

    bn, bk = block
    if bn == 128:
        fn = lambda w: pallas_quantize_weight_blockwise(w, 128, interpret=False, check=False)  # noqa: E731
    else:  # activations: 1 x 128 groups in row blocks of bn
        fn = lambda w: pallas_quantize_activation_groupwise(w[0], 128, block_rows=bn, interpret=False,  # noqa: E731
                                                             check=False)
    hlo, kernels = _lower_for_cuda(fn, S(shape, jnp.float32))
    assert len(kernels) == 1
    n_pad, k_pad = padded_tile_shape(shape[1], shape[2], bn, bk)
    grid = re.search(r"grid_x = (\d+) : i32, grid_y = (\d+) : i32, grid_z = (\d+) : i32", hlo).groups()
    assert tuple(map(int, grid)) == (shape[0], n_pad // bn, k_pad // bk)
    call = next(line for line in hlo.splitlines() if "__gpu$xla.gpu.triton" in line)
    operand = re.search(r"\(tensor<([\dx]+)xf32>\)", call).group(1)
    assert tuple(int(d) for d in operand.split("x"))[-2:] == (n_pad, k_pad)  # grid * block == operand: no overhang
    # the kernel body itself loads and stores whole (bn, bk) tiles, with no mask operand
    assert f"tensor<{bn}x{bk}xf32>" in kernels[0]


@pytest.mark.parametrize("precision,kv", [("fp8", "auto"), ("bf16", "auto"), ("fp8", "fp8_e4m3")])
def test_engine_generate_program_lowers_for_cuda(precision, kv):
    """The embedded engine's whole jitted prefill + decode loop (``rollout.engine._generate``) lowers for CUDA on
    this CPU machine: FP8 linears as the swap-AB Mosaic GPU decode GEMM (prefill and decode rows <= 64 here), an e4m3
    KV cache as f8 tensors."""
    from fp8rl_jax.export import export_weights
    from fp8rl_jax.models.config import ModelConfig
    from fp8rl_jax.models.decoder import named_params
    from fp8rl_jax.models.loading import build_model
    from fp8rl_jax.rollout import engine as eng_mod

    cfg = ModelConfig(model_type="qwen3", vocab_size=512, hidden_size=256, intermediate_size=512,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      eos_token_id=2, pad_token_id=0)
    fmt = eng_mod.ENGINE_PRECISIONS[precision][2]
    n = cfg.num_hidden_layers
    kv_scales = None
    if kv == "fp8_e4m3":
        from fp8rl_jax.fp8.kv_cache import KVScales

        kv_scales = KVScales(*(np.full(n, 0.01, np.float32),) * 3)
    w = export_weights(named_params(build_model(cfg, seed=0)), fmt, kv_scales=kv_scales,
                       kv_scales_version=0 if kv_scales else None)
    e = eng_mod.JaxRolloutEngine(cfg, w, precision=precision, kv_cache_dtype=kv, log_kv_cache=False)
    ids, mask = np.zeros((2, 16), np.int32), np.ones((2, 16), bool)
    scales = (e.kv_scales.k_scale, e.kv_scales.v_scale, None) if kv == "fp8_e4m3" else (None, None, None)
    with lowering_for_h100():
        lowered = eng_mod._generate.trace(
            e.graphdef, e.state, ids, mask, jax.random.key(0), np.int32(0), np.float32(1.0), np.int32(1),
            np.float32(1.0),
            np.array([2], np.int32), *scales, n=2, max_tokens=8, greedy=False, use_top_k=False, use_top_p=False,
            pad_token_id=0, cache_dtype=e.cache_dtype).lower(lowering_platforms=("cuda",))
    hlo = lowered.as_text()
    assert "stablehlo.while" in hlo  # the decode loop
    kernel_calls = hlo.count("__gpu$xla.gpu.triton") + hlo.count("stablehlo.custom_call @mosaic_gpu")
    if precision == "fp8":  # M <= 64: the swap-AB Mosaic decode GEMM (issue 37); the FP8-KV attention is Triton
        assert "fp8_decode_gemm_swapab_wgmma" in hlo and kernel_calls > 0 and "xf8E4M3FN" in hlo
    else:
        assert kernel_calls == 0
    if kv == "fp8_e4m3":
        assert re.search(r"tensor<2x24x2x64xf8E4M3FN>", hlo)  # the e4m3 cache [B, P + T, H_kv, D]
