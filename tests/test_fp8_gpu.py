"""FP8 kernels compiled and run on a CUDA GPU, against the CPU jnp reference and float64 numpy.

Every test here needs a CUDA GPU and is skipped without one (CI has none); `benchmarks/run_gpu.sh` runs this
file first on a GPU machine. The same kernels' Triton IR is checked on any machine in test_fp8_pallas.py.

* The Pallas quantization kernels (Triton, ``interpret=False``) equal the jnp reference computed on the CPU
  bit for bit: uint8 patterns of the e4m3 values and float32 scales, for every recipe, UE8M0, ragged stacks.
* The jnp quantizer compiled by XLA for the GPU equals the same reference (XLA GPU's division and the
  integer-bit e4m3 cast are exact there too).
* The Pallas W8A8 GEMM and the per-K-block real-FP8 ``lax.dot_general`` equal the float64 product of the
  dequantized operands to float32 accumulation error.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8rl_jax.fp8 import quant
from fp8rl_jax.fp8.dot_general import scaled_matmul
from fp8rl_jax.fp8.pallas_gemm import pallas_w8a8_matmul
from fp8rl_jax.fp8.pallas_quant import (gpu_lowering_available, pallas_quantize_activation_groupwise,
                                        pallas_quantize_weight_blockwise)
from fp8_problems import assert_same_quant as _same
from fp8_problems import QUANT_RECIPES as RECIPES
from fp8_problems import quant_test_data as _data

pytestmark = pytest.mark.skipif(not gpu_lowering_available(), reason="needs a CUDA GPU (none on this machine)")


def _cpu(fn, *arrays):
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        return fn(*[jax.device_put(a, cpu) for a in arrays])


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.name.split()[0])
@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_weight_kernel_on_gpu_equals_cpu_reference(recipe, ue8m0, dtype):
    x = jnp.asarray(_data((3, 384, 640), seed=11)).astype(dtype)
    x_host = np.asarray(x)
    want = _cpu(lambda a: quant.quantize_weight_blockwise(a, 128, ue8m0, recipe=recipe), x_host)
    _same(pallas_quantize_weight_blockwise(x, 128, ue8m0, recipe=recipe, interpret=False), want)
    _same(quant.quantize_weight_blockwise(x, 128, ue8m0, recipe=recipe), want)  # XLA GPU, jnp path


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.name.split()[0])
@pytest.mark.parametrize("ue8m0", [False, True])
def test_activation_kernel_on_gpu_equals_cpu_reference(recipe, ue8m0):
    x = jnp.asarray(_data((257, 896), seed=12)).astype(jnp.bfloat16)
    want = _cpu(lambda a: quant.quantize_activation_groupwise(a, 128, ue8m0, recipe=recipe), np.asarray(x))
    _same(pallas_quantize_activation_groupwise(x, 128, ue8m0, recipe=recipe, interpret=False), want)
    _same(quant.quantize_activation_groupwise(x, 128, ue8m0, recipe=recipe), want)


def test_gpu_kernel_ragged_and_nonfinite():
    x = jnp.asarray(_data((2, 129, 257), seed=13))
    want = _cpu(lambda a: quant.quantize_weight_blockwise(a), np.asarray(x))
    _same(pallas_quantize_weight_blockwise(x, interpret=False), want)
    with pytest.raises(ValueError, match="NaN or inf"):
        pallas_quantize_weight_blockwise(x.at[0, 5, 5].set(jnp.nan), interpret=False)


def _dequant64(q, s, rows_per_scale):
    qf = np.asarray(q.astype(jnp.float32), np.float64)
    s64 = np.repeat(np.repeat(np.asarray(s, np.float64), rows_per_scale, axis=0), 128, axis=1)
    return qf * s64[: qf.shape[0], : qf.shape[1]]


@pytest.mark.parametrize("m", [1, 64, 300])
def test_w8a8_gemm_on_gpu_matches_float64(m):
    rng = np.random.default_rng(m)
    x = jnp.asarray(rng.standard_normal((m, 1024)).astype(np.float32))
    w = jnp.asarray((rng.standard_normal((640, 1024)) * 0.02).astype(np.float32))
    xq, xs = quant.quantize_activation_groupwise(x, check=False)
    wq, ws = quant.quantize_weight_blockwise(w, check=False)
    ref = _dequant64(xq, xs, 1) @ _dequant64(wq, ws, 128).T
    y = np.asarray(pallas_w8a8_matmul(xq, xs, wq, ws, interpret=False))
    assert y.shape == (m, 640) and np.isfinite(y).all()
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 1e-5
    ws_rows = jnp.repeat(ws, 128, axis=0)[:640]
    yb = np.asarray(scaled_matmul(xq[None], xs[None], wq[None], ws_rows[None], impl="blocked"))[0]
    assert np.linalg.norm(yb - ref) / np.linalg.norm(ref) < 1e-5
