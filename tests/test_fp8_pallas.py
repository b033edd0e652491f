"""The Pallas quantization kernels equal the jnp reference bit for bit (interpret mode on CPU)."""

import jax.numpy as jnp
import numpy as np
import pytest

from fp8rl_jax.fp8 import formats, quant
from fp8rl_jax.fp8.pallas_quant import (gpu_lowering_available, pallas_quantize_activation_groupwise,
                                        pallas_quantize_weight_blockwise)

RECIPES = [formats.VLLM_BLOCK_CAST, formats.VLLM_GROUP_NATIVE, formats.VLLM_GROUP_TRITON, formats.CONTRACT]


def _data(shape, seed, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * np.exp(rng.uniform(-4, 4, shape))).astype(np.float32)
    x.reshape(-1)[::97] = 0.0
    x.reshape(-1)[-1] = 3e4  # an outlier far above the rest of its block
    return jnp.asarray(x).astype(dtype)


def _same(a, b):
    np.testing.assert_array_equal(np.asarray(a[0]).view(np.uint8), np.asarray(b[0]).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(a[1]), np.asarray(b[1]))


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


def test_kernel_zero_blocks_and_nonfinite():
    x = jnp.zeros((256, 256), jnp.float32).at[200, 200].set(7.0)
    _same(pallas_quantize_weight_blockwise(x, interpret=True), quant.quantize_weight_blockwise(x))
    with pytest.raises(ValueError, match="NaN or inf"):
        pallas_quantize_weight_blockwise(x.at[3, 3].set(jnp.nan), interpret=True)
    with pytest.raises(ValueError, match="NaN or inf"):
        pallas_quantize_activation_groupwise(x.at[3, 3].set(-jnp.inf), interpret=True)


def test_backend_detection_on_this_machine():
    import jax

    assert gpu_lowering_available() == (jax.default_backend() == "gpu")
