"""Issue 28: kernels chosen by the platform a program is lowered for; the self-test, fallback and switch; exact
rounding on CUDA; FP8 training's e5m2 backward and the MoE combine lowered for CUDA.

Everything here runs on the CPU: CUDA programs are lowered (StableHLO with Triton / cuDNN custom calls) against an
abstract H100 (:func:`fp8rl_jax.gpu_target.lowering_for_h100`), the CUDA-only numerics are run on the CPU with an
approximate division that errs by up to 2 ulps (what XLA:GPU's ``div.full.f32`` may do), and the self-test machinery
runs with the CPU standing in for the GPU. The deviceless sm_90a compile of whole programs is
scripts/compile_h100.py (run by ``make test``).
"""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax

from fp8rl_jax.fp8 import formats

from fp8rl_jax.kernels import registry
from fp8rl_jax.gpu_target import lowering_for_h100

S = jax.ShapeDtypeStruct
E4M3 = jnp.float8_e4m3fn


def _cuda_text(fn, *args) -> str:
    with lowering_for_h100():
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _cpu_text(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cpu",)).as_text()


def _kernel_calls(text: str) -> int:
    """Pallas kernels in a lowered module: Triton custom calls and Mosaic GPU custom calls."""
    return text.count("__gpu$xla.gpu.triton") + text.count("stablehlo.custom_call @mosaic_gpu")


# -- the switch ----------------------------------------------------------------------------------------------------


def test_mode_from_env_setter_and_named_errors(monkeypatch):
    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    registry.set_kernel_mode(None)
    assert registry.kernel_mode() == "auto"
    monkeypatch.setenv(registry.ENV_VAR, "XLA")
    assert registry.kernel_mode() == "xla"
    monkeypatch.setenv(registry.ENV_VAR, "triton")
    with pytest.raises(ValueError, match=r"FP8RL_KERNELS='triton' is not a kernel mode"):
        registry.kernel_mode()
    with registry.kernel_mode_scope("pallas"):  # the setter wins over the environment
        assert registry.kernel_mode() == "pallas"
    with pytest.raises(ValueError, match="not a kernel mode"):
        registry.set_kernel_mode("fast")
    monkeypatch.delenv(registry.ENV_VAR)
    assert registry.kernel_mode() == "auto"


def test_xla_mode_compiles_no_kernel_for_cuda():
    """``FP8RL_KERNELS=xla`` (here the setter): the CUDA program of an FP8 linear (M=200: the Mosaic GPU GEMM) and of
    the export (the Triton quantizer) has no Pallas kernel; ``auto`` has them."""
    from fp8rl_jax.fp8 import linear
    from fp8rl_jax.kernels import pallas_quant

    args = (S((200, 256), jnp.bfloat16), S((256, 256), E4M3), S((2, 2), jnp.float32))
    for mode, want in (("auto", True), ("xla", False)):
        # new functions per mode: the mode is read when a program is traced (set it before the first call)
        gemm = lambda x, w, s: linear.w8a8_block_matmul(x, w, s)  # noqa: E731
        quant = lambda w: pallas_quant.quantize_weights_batched([w], check=False)  # noqa: E731
        with registry.kernel_mode_scope(mode):
            assert (_kernel_calls(_cuda_text(gemm, *args)) > 0) == want, mode
            assert (_kernel_calls(_cuda_text(quant, S((256, 256), jnp.bfloat16))) > 0) == want, mode


def test_train_config_kernels_reach_the_switch(tmp_path, monkeypatch):
    """``train.kernels`` sets the mode for the run (None leaves ``$FP8RL_KERNELS``); kv_attention and expert_impl are
    validated by name."""
    from fp8rl_jax.trainer.config import TrainConfig

    with pytest.raises(ValueError, match="train.kernels='triton' is not one of"):
        TrainConfig(kernels="triton")
    with pytest.raises(ValueError, match="train.kv_attention='flash' is not one of"):
        TrainConfig(kv_attention="flash")
    with pytest.raises(ValueError, match="train.expert_impl='megablox' is not one of"):
        TrainConfig(expert_impl="megablox")
    import gin

    from fp8rl_jax.trainer import config as _  # noqa: F401  (registers the configurable)

    gin.clear_config()
    try:
        gin.parse_config(['train.kernels = "xla"', 'train.expert_impl = "tiled"'])
        cfg = TrainConfig()
        assert cfg.kernels == "xla" and cfg.expert_impl == "tiled"
    finally:
        gin.clear_config()


# -- self-test and fallback ------------------------------------------------------------------------------------------


@pytest.fixture
def cpu_as_gpu(monkeypatch):
    """The CPU stands in for "the CUDA device" of the self-test machinery; results are reset before and after."""
    monkeypatch.setattr(registry, "cuda_device", lambda: jax.devices("cpu")[0])
    monkeypatch.setattr(registry, "_results", {})
    monkeypatch.setattr(registry, "_failures", {})
    registry.set_kernel_mode("auto")
    yield
    registry.set_kernel_mode(None)


def test_failed_selftest_warns_once_and_falls_back_to_xla(cpu_as_gpu, monkeypatch):
    def broken():
        raise registry.KernelMismatch("e4m3 codes differ in 3 of 100 values")

    monkeypatch.setitem(registry._selftests, "w8a8_gemm", broken)
    calls = []
    kernel = lambda x: calls.append("kernel") or x * 2  # noqa: E731
    xla = lambda x: calls.append("xla") or x * 3  # noqa: E731
    with pytest.warns(RuntimeWarning, match=r"W8A8 blockwise FP8 GEMM .* failed its self-test .*e4m3 codes differ.*"
                                            r"FP8RL_KERNELS=pallas forces"):
        out = registry.choose("w8a8_gemm", jnp.ones(3), kernel=kernel, xla=xla)
    np.testing.assert_array_equal(out, 3.0)
    assert calls == ["xla"]  # the kernel is not even staged
    assert registry.selftest_failures() == {"w8a8_gemm": "KernelMismatch: e4m3 codes differ in 3 of 100 values"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process
        assert registry.use_kernel("w8a8_gemm") is False
    with registry.kernel_mode_scope("pallas"):  # forced: the kernel despite the failed test
        assert registry.use_kernel("w8a8_gemm") is True


def test_selftest_runs_once_even_mid_trace(cpu_as_gpu, monkeypatch):
    runs = []
    monkeypatch.setitem(registry._selftests, "quant", lambda: runs.append(float(jnp.sum(jnp.ones(4)))))

    @jax.jit
    def f(x):  # the self-test runs while f is being traced (its own eager computation, in another thread)
        return registry.choose("quant", x, kernel=lambda a: a + 1, xla=lambda a: a - 1)

    np.testing.assert_array_equal(f(jnp.zeros(2)), -1.0)  # computed on the CPU: the XLA branch
    f(jnp.zeros(3))
    assert runs == [4.0]


def test_selftest_seconds_records_each_run_passed_or_failed(cpu_as_gpu, monkeypatch):
    """``selftest_seconds`` (what bench_rollout subtracts from a first call) holds each family's self-test wall time,
    at least what the test itself measured, once per process, for a failing test too."""
    import time

    monkeypatch.setattr(registry, "_selftest_s", {})
    took = {}

    def slow(name, fail=False):
        def test():
            t0 = time.perf_counter()
            time.sleep(0.02)
            took[name] = time.perf_counter() - t0
            if fail:
                raise registry.KernelMismatch("1 code differs")
        return test

    monkeypatch.setitem(registry._selftests, "quant", slow("quant"))
    monkeypatch.setitem(registry._selftests, "w8a8_gemm", slow("w8a8_gemm", fail=True))
    assert registry.selftest_seconds() == {}
    assert registry.use_kernel("quant") is True
    with pytest.warns(RuntimeWarning, match="1 code differs"):
        assert registry.use_kernel("w8a8_gemm") is False
    secs = registry.selftest_seconds()
    assert set(secs) == {"quant", "w8a8_gemm"}
    assert all(took[f] <= secs[f] < took[f] + 5.0 for f in secs)
    registry.use_kernel("quant")  # decided: not run again, not charged again
    assert registry.selftest_seconds() == secs
    secs["quant"] = -1.0  # a copy
    assert registry.selftest_seconds()["quant"] > 0


def test_a_family_without_a_registered_selftest_fails_it(cpu_as_gpu, monkeypatch):
    """A kernel whose module never registered its self-test is not trusted untested (the grouped-expert module was
    once imported only inside its kernel branch, after the choice)."""
    monkeypatch.delitem(registry._selftests, "grouped_experts", raising=False)
    with pytest.warns(RuntimeWarning, match=r"grouped W8A8 MoE expert GEMM .* failed its self-test .*no self-test "
                                            r"registered for kernel family 'grouped_experts'"):
        assert registry.use_kernel("grouped_experts") is False


def test_the_registering_modules_are_imported_with_the_model():
    """Every family's self-test is registered once the model and engine modules are imported (what a program that
    chooses a kernel has imported), so none can be chosen before its test exists."""
    import fp8rl_jax.models.moe  # noqa: F401
    import fp8rl_jax.rollout.engine  # noqa: F401

    assert set(registry._selftests) == set(registry.FAMILIES)


def test_a_choice_inside_a_selftest_does_not_wait(cpu_as_gpu, monkeypatch):
    """A self-test whose own path chooses another family's kernel neither deadlocks nor runs that family's test
    (it runs in a marked thread, and the first family's lock is held meanwhile)."""
    runs = []

    def inner():
        runs.append("decode_gemm")

    def outer():
        runs.append("w8a8_gemm")
        out = registry.choose("decode_gemm", jnp.ones(2), kernel=lambda a: a + 1, xla=lambda a: a - 1)
        runs.append(float(out[0]))

    monkeypatch.setitem(registry._selftests, "w8a8_gemm", outer)
    monkeypatch.setitem(registry._selftests, "decode_gemm", inner)
    assert registry.use_kernel("w8a8_gemm") is True
    assert runs == ["w8a8_gemm", 0.0]  # eager on the CPU: the XLA branch; decode_gemm's own test not run from there
    assert registry.use_kernel("decode_gemm") is True and runs[-1] == "decode_gemm"


def test_choose_without_a_family_is_the_platform_branch(cpu_as_gpu, monkeypatch):
    """``choose(None, ...)``: XLA's own CUDA path (e.g. its FP8 dot for e5m2 x e4m3): no self-test gates it, and the
    kernel mode does not either; lowered for CUDA it is the ``kernel`` branch."""
    monkeypatch.setitem(registry._selftests, "w8a8_gemm", lambda: pytest.fail("no self-test may run"))

    def f(x):
        return registry.choose(None, x, kernel=lambda a: a + 1, xla=lambda a: a - 1)

    np.testing.assert_array_equal(f(jnp.ones(2)), 0.0)
    with registry.kernel_mode_scope("xla"):
        cuda = _cuda_text(f, S((2,), jnp.float32))
    assert "stablehlo.add" in cuda and "stablehlo.subtract" not in cuda
    assert "stablehlo.subtract" in _cpu_text(f, S((2,), jnp.float32))


@pytest.mark.parametrize("family", ["quant", "decode_gemm", "grouped_decode", "grouped_experts", "fp8_kv_attention"])
def test_each_kernel_selftest_passes_and_catches_a_wrong_kernel(family, monkeypatch):
    """Every Triton family's self-test and the swap-AB decode GEMMs' (dense and grouped; in interpret mode here)
    passes with the real kernel and raises KernelMismatch
    when the kernel's result is off: scaled by 1 + 2**-12 (a wrong scale), or one e4m3 code flipped (quant). The
    ``w8a8_gemm`` family's (the Mosaic GPU GEMM) is tested in test_wgmma_paths.py."""
    from fp8rl_jax.kernels import pallas_attention, pallas_grouped, pallas_quant
    from fp8rl_jax.kernels import decode_gemm_mgpu, decode_grouped_mgpu

    mod, fns = {"quant": (pallas_quant, ["_pallas_quantize_3d", "_pallas_quantize_for_decode"]),
                "decode_gemm": (decode_gemm_mgpu, ["_partials"]),
                "grouped_decode": (decode_grouped_mgpu, ["_grouped"]),
                "grouped_experts": (pallas_grouped, ["_grouped"]),
                "fp8_kv_attention": (pallas_attention, ["_decode", "_prefill"])}[family]
    test = {"quant": pallas_quant._selftest_quant, "decode_gemm": decode_gemm_mgpu._selftest_decode_gemm,
            "grouped_decode": decode_grouped_mgpu._selftest_grouped_decode,
            "grouped_experts": pallas_grouped._selftest_grouped_experts,
            "fp8_kv_attention": pallas_attention._selftest_fp8_kv_attention}[family]
    assert registry._selftests[family] is test  # registered at import
    real = {fn: getattr(mod, fn) for fn in fns}

    def interpreted(fn):
        return lambda *a, **kw: real[fn](*a, **dict(kw, interpret=True))

    for fn in fns:
        monkeypatch.setattr(mod, fn, interpreted(fn))
    test()  # the real kernels pass

    def wrong(fn):
        def run(*a, **kw):
            out = interpreted(fn)(*a, **kw)
            if family == "quant":
                q, s = out
                bits = lax.bitcast_convert_type(q, jnp.uint8)
                first = (0,) * q.ndim
                return lax.bitcast_convert_type(bits.at[first].set(bits[first] ^ 1), q.dtype), s
            # the Mosaic decode GEMM's bound is 2**-10 of each output's sum of |terms| (Hopper's FP8 wgmma), about
            # 2**-6.5 of the output itself for these K ~ 300 random products: a 2**-4 wrong scale is what it must
            # catch; the Triton kernels' bounds are tighter
            eps = 2.0 ** -4 if family in ("decode_gemm", "grouped_decode") else 2.0 ** -12
            return jax.tree.map(lambda y: y * (1 + eps) if y.dtype == jnp.float32 else y, out)
        return run

    for fn in fns:  # each kernel of the family wrong in turn
        for other in fns:
            monkeypatch.setattr(mod, other, wrong(other) if other == fn else interpreted(other))
        with pytest.raises(registry.KernelMismatch):
            test()


# -- exact rounding on CUDA (item 3) ----------------------------------------------------------------------------------


def _normal_pairs(rng, n, lo=-60, hi=60):
    """float32 ``(a, b)`` with normal operands and quotients over a wide range of exponents (XLA:CPU flushes
    subnormal operands to zero, so they are left out)."""
    a = (rng.standard_normal(n) * np.exp2(rng.integers(lo, hi, n))).astype(np.float32)
    b = (np.abs(rng.standard_normal(n)) * np.exp2(rng.integers(lo, hi, n))).astype(np.float32)
    return a, np.maximum(b, np.finfo(np.float32).tiny)


def _near_midpoint_pairs(rng, n):
    """float32 ``(a, b)`` whose quotient lies ``r / (M S)`` (``|r| < 64``, about ``2**-49`` relative) from a float32
    rounding midpoint ``M / 2**25``: the hardest inputs for a division rounded twice. For an odd 24-bit ``S`` and odd
    ``r``, ``M = r * S**-1 mod 2**25`` (odd; kept when 25 bits long) makes ``M * S - r`` a multiple of ``2**25``, so
    ``a = (M * S - r) / 2**25`` is an integer below ``2**24`` and ``a / S = M / 2**25 - r / (S * 2**25)``. Scaled by
    powers of two (exact)."""
    a, b = [], []
    while len(a) < n:
        s_ = int(rng.integers(1 << 22, 1 << 23)) * 2 + 1
        r = int(rng.integers(-32, 32)) * 2 + 1
        m = (r * pow(s_, -1, 1 << 25)) % (1 << 25)
        if m >= 1 << 24:
            a.append((m * s_ - r) >> 25)
            b.append(s_)
    a = np.array(a, np.float64) * np.exp2(rng.integers(-40, 40, n))
    b = np.array(b, np.float64) * np.exp2(rng.integers(-40, 40, n))
    return a.astype(np.float32), b.astype(np.float32)


def test_div_rn_f64_is_ieee_float32_division():
    """The CUDA branch of div_rn: ``f32(f64(a) / f64(b))`` equals numpy's float32 ``a / b`` bit for bit (double
    rounding is innocuous for division, 53 >= 2 * 24 + 2) on random operands, the scale and reciprocal cases, and
    quotients within ~2**-49 of a float32 rounding midpoint (:func:`_near_midpoint_pairs`); so does the float64
    ``a * (1 / b)`` XLA's simplifier may substitute for a broadcast divisor. The lowered program divides in
    float64 (a float32 division would pass the comparison on the CPU, so the test reads the lowering too)."""
    rng = np.random.default_rng(0)
    n = 1 << 18
    a, b = _normal_pairs(rng, n)
    a[:4], b[:4] = [1.0, 448.0, 1e-4, 3.0], [448.0, 448.0, 448.0, 7.0]
    a_mid, b_mid = _near_midpoint_pairs(rng, 1 << 13)
    a, b = np.concatenate([a, a_mid]), np.concatenate([b, b_mid])
    got = np.asarray(jax.jit(formats.div_rn_f64)(a, b))
    with np.errstate(all="ignore"):
        want = a / b
    normal = np.isfinite(want) & (np.abs(want) >= np.finfo(np.float32).tiny) & (np.abs(a) >= np.finfo(np.float32).tiny)
    assert normal.sum() > 0.95 * len(a) and normal[-(1 << 13):].all()
    np.testing.assert_array_equal(got[normal].view(np.int32), want[normal].view(np.int32))
    rewritten = (a.astype(np.float64) * (1.0 / b.astype(np.float64))).astype(np.float32)
    np.testing.assert_array_equal(rewritten[normal].view(np.int32), want[normal].view(np.int32))
    # the near-midpoint quotients do separate roundings: float32's reciprocal-multiply misses most of them
    approx = a_mid * (np.float32(1) / b_mid)
    assert np.sum(approx.view(np.int32) != want[-(1 << 13):].view(np.int32)) > (1 << 13) // 4
    text = jax.jit(formats.div_rn_f64).lower(a, b).as_text()
    assert re.search(r"stablehlo\.divide [^\n]*xf64>", text) and not re.search(r"stablehlo\.divide [^\n]*xf32>", text)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_codes_from_div_rn_f64_equal_numpy(fmt):
    """The CUDA branch of scale_values (``cast(clip(div_rn_f64(x, s)))``): FP8 codes equal numpy's
    ``cast(clip(x / s))`` bit for bit, with half the values within 40 float32 ulps of an FP8 rounding midpoint, and
    NaN, infinities and zeros."""
    dt, mx = formats.fp8_dtype(fmt)
    np_dt = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}[fmt]
    rng = np.random.default_rng(3)
    n = 1 << 17
    s = (np.abs(rng.standard_normal(n)) * np.exp2(rng.integers(-30, 5, n)) + 1e-30).astype(np.float32)
    vals = np.arange(256, dtype=np.uint8).view(np_dt).astype(np.float32)
    vals = np.unique(np.abs(vals[np.isfinite(vals)]))
    vals = vals[vals <= mx]
    mids = ((vals[:-1] + vals[1:]) / 2).astype(np.float32)
    near = (rng.choice(mids, n) * s).astype(np.float32)
    near = (near.view(np.int32) + rng.integers(-40, 41, n).astype(np.int32)).view(np.float32)
    x = np.concatenate([np.where(rng.random(n) < 0.5, -near, near), (rng.standard_normal(n) * mx / 3 * s),
                        np.array([np.nan, np.inf, -np.inf, 0.0, -0.0], np.float32)]).astype(np.float32)
    s = np.concatenate([s, s, np.ones(5, np.float32)])
    want = np.clip(x / s, -mx, mx).astype(np_dt).view(np.uint8)
    got = jax.jit(lambda a, b: jnp.clip(formats.div_rn_f64(a, b), -mx, mx).astype(dt))(x, s)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8), want)


def test_every_jnp_quantizer_takes_the_exact_branch_when_lowered_for_cuda():
    """Item 3: lowered for CUDA the jnp quantizers (prefill activations, KV-cache writes, FP8 training, the export's
    jnp path) divide in float64 (:func:`formats.div_rn_f64`: XLA:GPU's float32 division is the approximate
    ``div.full.f32``, its float64 one ``div.rn.f64``); lowered for the CPU they keep IEEE float32 division and hold
    no float64 value."""
    from fp8rl_jax.fp8 import quant
    from fp8rl_jax.fp8.kv_cache import quantize_kv

    progs = {
        "activations": (lambda x: quant.quantize_activation_groupwise(x, check=False), S((8, 256), jnp.bfloat16)),
        "weights": (lambda w: quant.quantize_weight_blockwise(w, check=False), S((256, 256), jnp.bfloat16)),
        "kv write": (lambda k: quantize_kv(k, jnp.float32(0.02)), S((2, 4, 2, 64), jnp.bfloat16)),
    }
    for name, (fn, arg) in progs.items():
        cuda, cpu = _cuda_text(fn, arg), _cpu_text(fn, arg)
        assert re.search(r"stablehlo\.divide [^\n]*xf64>", cuda), name
        assert not re.search(r"stablehlo\.divide [^\n]*xf32>", cuda), name  # no float32 division left on CUDA
        assert "f64" not in cpu, name


def test_infinite_values_saturate_like_torch_on_the_cpu():
    """``x / s`` with ``x = +-inf`` and a finite scale is ``+-inf``, which the clip saturates to +-448 (torch's
    ``(x / s).clamp(-448, 448)``); NaN stays NaN. The CPU division hides the broadcast divisor from XLA with
    ``min(|x|, 0)``, which is 0 for infinite ``x`` (``x * 0`` would be NaN)."""
    from fp8rl_jax.fp8.kv_cache import quantize_kv

    x = np.array([[np.inf, -np.inf, np.nan, 1.0]], np.float32).reshape(1, 1, 1, 4)
    got = np.asarray(jax.jit(lambda k: quantize_kv(k, jnp.float32(0.5)))(jnp.asarray(x))).astype(np.float32).ravel()
    assert got[0] == 448.0 and got[1] == -448.0 and np.isnan(got[2]) and got[3] == 2.0, got
    q = np.asarray(jax.jit(lambda v, s: formats.scale_values(v, s))(jnp.asarray(x.ravel()), jnp.float32(2.0)))
    assert q.astype(np.float32).tolist()[:2] == [448.0, -448.0]


# -- FP8 training with e5m2 gradients (item 4) and the MoE block (item 5), lowered for CUDA -----------------------------


def test_fp8_training_e5m2_backward_lowers_for_cuda():
    """The e5m2 x e4m3 gradient products cannot run in a Pallas GEMM (Pallas-Triton and Mosaic GPU's wgmma need equal
    operand types): lowered for CUDA they are XLA FP8 dots with an e5m2 and an e4m3 operand; the e4m3 forward is the
    Mosaic GPU kernel, and no kernel gets an e5m2 operand."""
    from flax import nnx

    from fp8rl_jax.fp8.training import make_fp8_train_dot_general

    layer = nnx.Linear(256, 384, dot_general=make_fp8_train_dot_general("e5m2"), dtype=jnp.bfloat16,
                       param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    graph, state = nnx.split(layer)

    def loss(st, x):
        return jnp.sum(nnx.merge(graph, st)(x).astype(jnp.float32) ** 2)

    text = _cuda_text(jax.grad(loss), state, S((128, 256), jnp.bfloat16))
    assert re.search(r"stablehlo\.dot_general .*tensor<[\dx]+xf8E5M2>, tensor<[\dx]+xf8E4M3FN>\)", text)
    calls = [line for line in text.splitlines()
             if "__gpu$xla.gpu.triton" in line or "stablehlo.custom_call @mosaic_gpu" in line]
    assert any("f8E4M3FN" in line for line in calls) and not any("f8E5M2" in line for line in calls)


def test_moe_block_lowered_for_cuda_concatenates_no_stacks_and_scatter_adds_nothing():
    """Item 5: the FP8 MoE block's CUDA program reads the gate and up stacks in place (no [E, 2I, H] concatenation per
    call) and sums each token's experts with a gather and a reduction: no scatter-add, whose atomic order changes the
    result from run to run on a GPU (a float scatter-add; an integer one, bincount's, is exact in any order)."""
    from flax import nnx

    from fp8rl_jax.export import export_weights
    from fp8rl_jax.models.decoder import named_params
    from fp8rl_jax.models.loading import build_model
    from fp8rl_jax.kernels.decode_grouped_mgpu import KERNEL_NAME as KERNEL_NAME_GROUPED_DECODE
    from fp8rl_jax.models.moe import SparseMoeBlock, tiny_qwen3_moe_config

    cfg = tiny_qwen3_moe_config(300, hidden_size=256, moe_intermediate_size=256, num_experts=4)
    w = export_weights(named_params(build_model(cfg, seed=0)), "fp8_blockwise").tensors
    model = build_model(cfg, w, linear_precision="fp8", param_dtype="bfloat16", dtype="bfloat16")
    block = next(m for _, m in nnx.iter_modules(model) if isinstance(m, SparseMoeBlock))
    graph, state = nnx.split(block)
    fwd = lambda st, x: nnx.merge(graph, st)(x)  # noqa: E731
    text = _cuda_text(fwd, state, S((64, 256), jnp.bfloat16))
    # gate, up, down: the grouped swap-AB decode kernel (64 tokens x top-2 = 128 decode-sized rows), its jitted
    # wrapper called three times (gate and up share one lowered function: same shapes)
    assert len(re.findall(r"call @_grouped(_\d+)?\(", text)) == 3 and KERNEL_NAME_GROUPED_DECODE in text
    assert "fp8_w8a8_grouped_gemm" not in text  # not the Triton grouped kernel
    assert not re.search(r"stablehlo\.concatenate .*-> tensor<4x512x256xf8E4M3FN>", text)
    regions = re.findall(r'stablehlo\.scatter[^\n]*\{\n(.*?)\}', text, re.S)
    assert regions  # the inverse permutation is a scatter (of unique indices, a set)
    for region in regions:  # integer adds (bincount's group sizes) are exact in any order; float adds are not
        assert not re.search(r"stablehlo\.add .*: tensor<(f|bf)\d+>", region), region


@pytest.mark.parametrize("rows", [3, 100])
def test_linear_with_a_non_128_block_size_matches_float64_in_every_kernel_mode(rows):
    """``w8a8_block_matmul``'s "auto" choice with 64-wide blocks (no kernel family serves them: XLA's own path, family
    None, beyond 64 rows) in each ``FP8RL_KERNELS`` mode: the float64 product of the independently quantized
    operands (numpy reference: 1x64 activation groups, 64x64 weight blocks)."""
    import fp8_numpy_ref as ref
    from fp8rl_jax.fp8.linear import w8a8_block_matmul

    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, 128)).astype(np.float32)
    wq, ws = ref.quantize_blocks(rng.standard_normal((192, 128)).astype(np.float32), 64, 64, formats.WEIGHT_RECIPE)
    xq, xs = ref.quantize_blocks(x, 1, 64, formats.ACTIVATION_RECIPE)
    want = ref.dequantize_blocks(xq, xs, 1, 64) @ ref.dequantize_blocks(wq, ws, 64, 64).T
    for mode in ("auto", "xla", "pallas"):
        with registry.kernel_mode_scope(mode):
            y = w8a8_block_matmul(jnp.asarray(x), jnp.asarray(wq), jnp.asarray(ws), 64, jnp.float32)
        np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
