"""FP8 kernels compiled and run on a CUDA GPU, against an independent float64-numpy + ml_dtypes reference.

Every test here needs a CUDA GPU and is skipped without one (CI has none); ``benchmarks/run_gpu.sh`` runs this
file on a GPU machine and fails if any of it is skipped there. The same kernels' lowering is checked on any
machine in test_fp8_pallas.py.

* The Pallas quantization kernels (``interpret=False``) equal ``tests/fp8_numpy_ref.py`` (numpy float32 IEEE
  arithmetic on the host, ml_dtypes' e4m3 cast) bit for bit: uint8 patterns of the e4m3 values and float32
  scales, every recipe, UE8M0, ragged stacks whose edge tiles overhang.
* The jnp quantizer compiled by XLA for the GPU is compared with the same reference and must agree too.
* The Pallas W8A8 GEMM and the per-K-block FP8 ``lax.dot_general`` equal the float64 product of the
  dequantized operands within the tolerance of Hopper's FP8 tensor cores (see ``GEMM_RTOL``).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8rl_jax.fp8 import quant
from fp8rl_jax.fp8.dot_general import scaled_matmul
from fp8rl_jax.kernels.pallas_gemm import pallas_w8a8_matmul
from fp8rl_jax.kernels.registry import cuda_device
from fp8rl_jax.kernels.pallas_quant import pallas_quantize_activation_groupwise, pallas_quantize_weight_blockwise
import fp8_numpy_ref as ref
from fp8_problems import assert_same_quant as _same
from fp8_problems import assert_same_quant_arbitrated as _arbitrated
from fp8_problems import QUANT_RECIPES as RECIPES
from fp8_problems import quant_test_data as _data

# Relative Frobenius error allowed for an FP8 GEMM against the float64 product of its dequantized operands. On
# Hopper the e4m3 wgmma accumulates each 128-wide K block with ~14 significant bits (DeepSeek-V3 report, sec.
# 3.3.2), not full float32; the kernels promote every K block's partial sum into a float32 accumulator (as
# DeepGEMM does), so the error is that of 128-term partial sums at ~2^-14: ~sqrt(128) * 2^-14 ~ 7e-4 relative,
# plus float32 rounding of the scaled sums. vLLM's own block-FP8 GEMM test uses a mean relative difference < 1e-3
# (tests/kernels/quantization/test_block_fp8.py); we bound the relative Frobenius norm by the same 1e-3.
GEMM_RTOL = 1e-3

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(cuda_device() is None, reason="needs a CUDA GPU (none on this machine)")]


def _gpu(a):
    return jax.device_put(a, jax.devices("gpu")[0])


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.name.split()[0])
@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_weight_kernel_on_gpu_equals_cpu_reference(recipe, ue8m0, dtype):
    x_host = np.asarray(jnp.asarray(_data((3, 384, 640), seed=11)).astype(dtype))
    want = ref.quantize_blocks(x_host, 128, 128, recipe, ue8m0)
    x = _gpu(x_host)
    got = pallas_quantize_weight_blockwise(x, 128, ue8m0, recipe=recipe, interpret=False)
    assert got[0].devices() == {jax.devices("gpu")[0]}  # ran on the GPU
    xla = quant.quantize_weight_blockwise(x, 128, ue8m0, recipe=recipe)  # XLA GPU, jnp path
    if ue8m0:
        _same(got, want)
        _same(xla, want)
    else:  # a disagreement is arbitrated in exact arithmetic (issue 36, item 3)
        _arbitrated("Pallas weight quantizer", got, want, x_host, 128, 128, recipe)
        _arbitrated("XLA:GPU jnp weight quantizer", xla, want, x_host, 128, 128, recipe)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.name.split()[0])
@pytest.mark.parametrize("ue8m0", [False, True])
def test_activation_kernel_on_gpu_equals_cpu_reference(recipe, ue8m0):
    x_host = np.asarray(jnp.asarray(_data((257, 896), seed=12)).astype(jnp.bfloat16))
    want = ref.quantize_blocks(x_host, 1, 128, recipe, ue8m0)
    x = _gpu(x_host)
    got = pallas_quantize_activation_groupwise(x, 128, ue8m0, recipe=recipe, interpret=False)
    xla = quant.quantize_activation_groupwise(x, 128, ue8m0, recipe=recipe)
    if ue8m0:
        _same(got, want)
        _same(xla, want)
    else:
        _arbitrated("Pallas activation quantizer", got, want, x_host, 1, 128, recipe)
        _arbitrated("XLA:GPU jnp activation quantizer", xla, want, x_host, 1, 128, recipe)


def test_gpu_kernel_ragged_and_nonfinite():
    x_host = _data((2, 129, 257), seed=13)
    want = ref.quantize_blocks(x_host, 128, 128, quant.WEIGHT_RECIPE)
    x = _gpu(x_host)
    _same(pallas_quantize_weight_blockwise(x, interpret=False), want)
    for shape in ((1, 257, 896), (3, 200, 130)):  # more overhanging edges, both axes
        xs = _data(shape, seed=14)
        _same(pallas_quantize_weight_blockwise(_gpu(xs), interpret=False),
              ref.quantize_blocks(xs, 128, 128, quant.WEIGHT_RECIPE))
    with pytest.raises(ValueError, match="NaN or inf"):
        pallas_quantize_weight_blockwise(x.at[0, 5, 5].set(jnp.nan), interpret=False)


@pytest.mark.parametrize("m", [1, 3, 64, 300, 4096])
def test_w8a8_gemm_on_gpu_matches_float64(m):
    rng = np.random.default_rng(m)
    x = rng.standard_normal((m, 1024)).astype(np.float32)
    w = (rng.standard_normal((640, 1024)) * 0.02).astype(np.float32)
    xq, xs = ref.quantize_blocks(x, 1, 128, quant.ACTIVATION_RECIPE)
    wq, ws = ref.quantize_blocks(w, 128, 128, quant.WEIGHT_RECIPE)
    want = ref.dequantize_blocks(xq, xs, 1, 128) @ ref.dequantize_blocks(wq, ws, 128, 128).T
    xq_d, xs_d, wq_d, ws_d = (_gpu(a) for a in (xq, xs, wq, ws))
    y = np.asarray(pallas_w8a8_matmul(xq_d, xs_d, wq_d, ws_d, interpret=False), np.float64)
    assert y.shape == (m, 640) and np.isfinite(y).all()
    assert np.linalg.norm(y - want) / np.linalg.norm(want) < GEMM_RTOL
    ws_rows = jnp.repeat(ws_d, 128, axis=0)[:640]
    yb = np.asarray(scaled_matmul(xq_d[None], xs_d[None], wq_d[None], ws_rows[None], impl="blocked"), np.float64)[0]
    assert np.linalg.norm(yb - want) / np.linalg.norm(want) < GEMM_RTOL


@pytest.mark.parametrize("m,splits", [(1, None), (8, 4), (64, 1)])
def test_fused_decode_kernel_on_gpu_matches_float64(m, splits):
    """The one-launch split-K kernel quantizes the activation rows itself: same float64 product as the GEMM."""
    from fp8rl_jax.kernels.pallas_decode import fused_w8a8_decode_matmul

    rng = np.random.default_rng(100 + m)
    x = rng.standard_normal((m, 1024)).astype(np.float32)
    w = (rng.standard_normal((640, 1024)) * 0.02).astype(np.float32)
    xq, xs = ref.quantize_blocks(x, 1, 128, quant.ACTIVATION_RECIPE)
    wq, ws = ref.quantize_blocks(w, 128, 128, quant.WEIGHT_RECIPE)
    want = ref.dequantize_blocks(xq, xs, 1, 128) @ ref.dequantize_blocks(wq, ws, 128, 128).T
    y = np.asarray(fused_w8a8_decode_matmul(_gpu(x), _gpu(wq), _gpu(ws), splits=splits, interpret=False), np.float64)
    assert y.shape == (m, 640) and np.isfinite(y).all()
    assert np.linalg.norm(y - want) / np.linalg.norm(want) < GEMM_RTOL


def _qwen3_06b_shapes(layers: int = 2):
    """Qwen3-0.6B's real widths (hidden 1024, 16/8 heads of 128, MLP 3072, vocab 151936), ``layers`` layers."""
    from fp8rl_jax.models.config import ModelConfig

    return ModelConfig(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       max_position_embeddings=4096, rope_theta=1e6, tie_word_embeddings=True, eos_token_id=151645,
                       pad_token_id=151643)


@pytest.mark.parametrize("precision,kv", [("bf16", "auto"), ("fp8", "auto"), ("fp8", "fp8_e4m3")])
def test_engine_on_gpu_scores_like_a_float64_forward(precision, kv):
    """The embedded engine at Qwen3-0.6B widths (random weights, 2 layers, the final norm scaled so the logits are far
    from uniform: logprobs of random tokens around -11 +- 3, not -ln(vocab)) on the GPU: its teacher-forced logprobs
    are as close to a float64 numpy forward of exactly the served tensors (FP8 weights dequantized; no activation
    quantization) as the same engine's on the CPU, which the CPU suite proves (test_engine.py): a wrong scale or
    kernel on the GPU moves them several times further (tests/test_engine.py measures a single doubled
    ``weight_scale_inv`` at ~5x the FP8 engine's own error). generate() runs too."""
    from numpy_decoder_ref import logprobs64

    from fp8rl_jax.export import export_weights
    from fp8rl_jax.fp8.kv_cache import KVScales
    from fp8rl_jax.models.decoder import named_params
    from fp8rl_jax.models.loading import build_model
    from fp8rl_jax.rollout.engine import ENGINE_PRECISIONS, JaxRolloutEngine
    from fp8rl_jax.rollout.types import SamplingParams

    cfg = _qwen3_06b_shapes()
    cpu, gpu = jax.devices("cpu")[0], jax.devices("gpu")[0]
    with jax.default_device(cpu):
        params = {k: np.asarray(v) for k, v in named_params(build_model(cfg, seed=0, param_dtype=jnp.float32)).items()}
        params["model.norm.weight"] = params["model.norm.weight"] * 8  # logits far from uniform
        kvs = KVScales(*(np.full(2, 0.05, np.float32),) * 3) if kv == "fp8_e4m3" else None
        w = export_weights(params, ENGINE_PRECISIONS[precision][2], kv_scales=kvs,
                           kv_scales_version=0 if kvs else None)
        host = {k: np.asarray(v) for k, v in w.tensors.items()}
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(0, 150000, 24))), list(map(int, rng.integers(0, 150000, 9)))]
    conts = [list(map(int, rng.integers(0, 150000, 8))), list(map(int, rng.integers(0, 150000, 5)))]
    ref = np.concatenate([logprobs64(cfg, host, p, c) for p, c in zip(prompts, conts)])
    assert ref.std() > 1.0 and ref.mean() < -np.log(cfg.vocab_size) - 1.0  # far from uniform
    err = {}
    for name, dev in (("cpu", cpu), ("gpu", gpu)):
        with jax.default_device(dev):
            wd = type(w)({k: jax.device_put(v, dev) for k, v in host.items()}, w.format, w.block_size, 0,
                         dict(w.metadata))
            eng = JaxRolloutEngine(cfg, wd, precision=precision, kv_cache_dtype=kv, log_kv_cache=False)
            err[name] = float(np.mean(np.abs(np.concatenate(eng.score(prompts, conts)) - ref)))
            if name == "gpu":
                rb = eng.generate(prompts, SamplingParams(n=2, max_tokens=8, seed=0))
                assert rb.response_token_ids.shape == (4, 8) and np.isfinite(rb.rollout_logprobs).all()
    # bf16 activations and the FP8 GEMMs' accumulation order differ between XLA:CPU and the GPU kernels: allow 1.5x
    assert err["gpu"] <= 1.5 * err["cpu"] + 0.03, err


def test_every_kernel_family_passes_its_selftest_on_the_gpu():
    """Issue 28 (6): on the GPU every kernel family's one-time self-test (fp8rl_jax.kernels.registry) passes, so "auto"
    runs the project's kernels and nothing silently falls back to XLA; a failure here names the kernel and its error."""
    from fp8rl_jax.kernels import registry
    from fp8rl_jax.kernels import pallas_attention, pallas_decode, pallas_grouped, pallas_quant  # noqa: F401 (register)
    from fp8rl_jax.kernels import mosaic_gemm  # noqa: F401
    from fp8rl_jax.models import attention_impl  # noqa: F401

    with registry.kernel_mode_scope("auto"):
        results = {family: registry.selftest_passed(family) for family in registry.FAMILIES}
    assert all(results.values()), registry.selftest_failures()
