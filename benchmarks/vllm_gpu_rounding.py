"""How far vLLM's GPU FP8 quantizers round from this project's contract (docs/FP8.md, "vLLM's GPU kernels").

numpy only (float32 ``/`` and ``*`` are IEEE round-to-nearest-even on the CPU; the e4m3 cast is ml_dtypes'
round-to-nearest-even after a clip to +-448), no GPU and no vLLM needed. Each vLLM GPU quantizer is written out
from its source as float32 operations:

* exact emulations: IEEE ``div.rn.f32`` (nvcc without ``--use_fast_math``), reciprocal multiplies ``x * RN(1/s)``,
  ATen's CUDA ``tensor / python_scalar`` (``a * RN(1/b)``) and Inductor's division by a constant (``a * (1/b)``);
* bounds: Triton's and Inductor's float32 ``/`` is the PTX ``div.full.f32`` (at most 2 ulp off, not documented
  bit for bit). Its FP8 code can differ from the correctly rounded quotient's only where the exact quotient
  lies within 2 float32 ulps of an e4m3 rounding midpoint, and then by one code; the script counts those.

The reference ("ours") is the project's preset for the same role (``formats.VLLM_GROUP_NATIVE`` for activation
groups, ``VLLM_BLOCK_CAST`` for weight blocks, ``VLLM_TENSOR_NATIVE`` per token, ``x / s`` for the KV cache
and queries), which the project computes exactly on CPU and on CUDA. ``--check-jax`` verifies that the numpy
references equal the project's JAX quantizers bit for bit on the same data.

    python benchmarks/vllm_gpu_rounding.py [--rows 1024] [--seed 0] [--check-jax] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

import ml_dtypes
import numpy as np

F32 = np.float32
E4M3 = ml_dtypes.float8_e4m3fn
FP8_MAX = F32(448.0)
INV_448 = F32(1.0) / FP8_MAX  # RN(1/448): what ATen / Inductor / Triton multiply by instead of dividing
MIN_SCALE = F32(1.0 / (448.0 * 512.0))  # vLLM _FP8_MIN_SCALING_FACTOR / min_scaling_factor
GROUP = 128
# e4m3 magnitudes (codes 0..126) and the 126 rounding midpoints between neighbours.
_VALS = np.arange(127, dtype=np.uint8).view(E4M3).astype(np.float64)
_MIDS = (_VALS[:-1] + _VALS[1:]) / 2


def bf16_round(x: np.ndarray) -> np.ndarray:
    """float32 -> nearest bfloat16 (ties to even), returned as float32 (exact)."""
    u = np.ascontiguousarray(x, F32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(F32)


def e4m3_codes(v: np.ndarray) -> np.ndarray:
    """Saturating round-to-nearest-even float32 -> e4m3 (``__NV_SATFINITE`` / clamp-then-cast), as uint8 codes."""
    return np.clip(v.astype(F32), -FP8_MAX, FP8_MAX).astype(E4M3).view(np.uint8)


def e4m3_value(c: np.ndarray) -> np.ndarray:
    return c.view(E4M3).astype(F32)


def ordinal(c: np.ndarray) -> np.ndarray:
    """Signed position on the e4m3 number line (adjacent codes differ by 1, +0 and -0 both 0)."""
    mag = (c & 0x7F).astype(np.int32)
    return np.where(c & 0x80, -mag, mag)


def near_midpoint(x: np.ndarray, s: np.ndarray, ulps: float = 2.0) -> np.ndarray:
    """True where the exact ``x / s`` lies within ``ulps`` float32 ulps of an e4m3 rounding midpoint (below 448).

    float64 holds the float32 quotient to 2**-53 relative, far below the 2**-22 window (an exact tie is exact).
    The ulp is the float32 spacing just above the midpoint (>= the one below, so the count is an upper bound).
    """
    q = np.abs(x.astype(np.float64) / s.astype(np.float64))
    i = np.clip(np.searchsorted(_MIDS, q), 1, len(_MIDS) - 1)
    lo, hi = _MIDS[i - 1], _MIDS[i]
    m = np.where(np.abs(q - lo) <= np.abs(q - hi), lo, hi)
    ulp = np.exp2(np.floor(np.log2(m)) - 23)
    return (np.abs(q - m) <= ulps * ulp) & (q < 448.0)


# ---------------------------------------------------------------------------------------------- recipes
def group_view(x: np.ndarray) -> np.ndarray:
    return x.reshape(x.shape[0], -1, GROUP)


def group_amax(x: np.ndarray) -> np.ndarray:
    return np.abs(group_view(x)).max(axis=-1, keepdims=True)


def block_view(w: np.ndarray) -> np.ndarray:
    n, k = w.shape
    return w.reshape(n // GROUP, GROUP, k // GROUP, GROUP)


def block_amax(w: np.ndarray) -> np.ndarray:
    return np.abs(block_view(w)).max(axis=(1, 3), keepdims=True)


def quant(xg: np.ndarray, s: np.ndarray, how: str) -> np.ndarray:
    """e4m3 codes of ``xg`` with a broadcastable scale: ``how`` = "div" (``x / s``) or "recip" (``x * RN(1/s)``)."""
    if how == "div":
        return e4m3_codes(xg / s)
    return e4m3_codes(xg * (F32(1.0) / s))


def ue8m0_torch(s: np.ndarray) -> np.ndarray:
    """``exp2(ceil(log2 s))`` with a correctly rounded float32 log2 (torch on CPU; the project's ``ceil_pow2``)."""
    lg = np.log2(s.astype(np.float64)).astype(F32)
    return np.exp2(np.ceil(lg).astype(np.float64)).astype(F32)


def ue8m0_bits(s: np.ndarray) -> np.ndarray:
    """vLLM's CUDA register kernels: bump the exponent when the mantissa is non-zero, clear the mantissa."""
    b = np.maximum(np.abs(s), F32(1e-10)).astype(F32).view(np.uint32)
    e = ((b >> 23) & 0xFF) + ((b & 0x7FFFFF) != 0)
    return (e.astype(np.uint32) << 23).view(F32)


# ---------------------------------------------------------------------------------------------- data
def activations(kind: str, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """bf16 activations ``[rows, k]`` (as float32): "normal", "student_t3" (heavy tails) or "outlier_channels"."""
    if kind == "normal":
        x = rng.standard_normal((rows, k))
    elif kind == "student_t3":
        x = rng.standard_t(3, (rows, k))
    elif kind == "outlier_channels":  # LLM-like: 1 % of hidden channels carry ~30x larger values
        x = rng.standard_normal((rows, k))
        cols = rng.choice(k, size=max(1, k // 100), replace=False)
        x[:, cols] *= 30.0
    else:
        raise ValueError(kind)
    return bf16_round(x.astype(F32))


# ---------------------------------------------------------------------------------------------- comparison
def compare(x: np.ndarray, q_ref, s_ref, q_new, s_new, bound_mask=None) -> dict:
    """Code / scale / dequantized-value differences of (q_new, s_new) against (q_ref, s_ref) on the same groups."""
    s_ref = np.broadcast_to(s_ref, q_ref.shape)
    s_new = np.broadcast_to(s_new, q_new.shape)
    d_ref = e4m3_value(q_ref) * s_ref
    d_new = e4m3_value(q_new) * s_new
    diff = q_ref != q_new
    dcode = np.abs(ordinal(q_ref).astype(np.int64) - ordinal(q_new))
    nz = d_ref != 0
    rel = np.zeros_like(d_ref)
    rel[nz] = np.abs(d_new[nz] - d_ref[nz]) / np.abs(d_ref[nz])
    fp8_err = np.abs(d_ref.astype(np.float64) - x.reshape(d_ref.shape))
    out = {
        "frac_codes": float(diff.mean()),
        "n_codes": int(diff.sum()),
        "max_code_steps": int(dcode.max()),
        "max_rel_value": float(rel.max()),
        "frac_scales": float((s_ref != s_new).mean()),
        # mean |deq_new - deq_ref| over mean |deq_ref - x|: the mismatch in units of the FP8 error itself
        "vs_fp8_error": float(np.abs(d_new.astype(np.float64) - d_ref).mean() / fp8_err.mean()),
        # the same in RMS (what adds in quadrature to the FP8 error downstream)
        "rms_vs_fp8_error": float(np.sqrt(((d_new.astype(np.float64) - d_ref) ** 2).mean() / (fp8_err ** 2).mean())),
        "fp8_rel_rms": float(np.sqrt((fp8_err ** 2).mean() / (x.astype(np.float64) ** 2).mean())),
    }
    if bound_mask is not None:
        out["bound_frac_codes"] = float((diff | bound_mask.reshape(diff.shape)).mean())
    return out


def activation_rows(x: np.ndarray) -> dict[str, dict]:
    """All activation-side comparisons on one dataset ``x`` [rows, K] (bf16 values in float32)."""
    xg = group_view(x)
    amax = group_amax(x)
    res = {}
    # ours: VLLM_GROUP_NATIVE = QuantFP8(group 1x128).forward_native on CPU
    s_ours = np.maximum(amax / FP8_MAX, MIN_SCALE)
    q_ours = quant(xg, s_ours, "div")
    # (1) CUDA per_token_group_fp8_quant (csrc/.../per_token_group_quant.cu): local_absmax starts at eps,
    #     y_s = absmax / max_8bit, q = x / y_s; IEEE (no fast-math) -> exact emulation
    s = np.maximum(amax, F32(1e-10)) / FP8_MAX
    res["cuda_per_token_group"] = compare(x, q_ours, s_ours, quant(xg, s, "div"), s)
    # (2) Triton per_token_group_quant_fp8: scale = max(amax, eps) * (1.0 / fp8_max); y / y_s is div.full.f32
    s = np.maximum(amax, F32(1e-10)) * INV_448
    res["triton_per_token_group"] = compare(x, q_ours, s_ours, quant(xg, s, "div"), s, near_midpoint(xg, s))
    # (3) forward_native compiled by Inductor on CUDA: amax / 448.0 -> amax * (1/448) (div by constant);
    #     x / scales -> Triton "/" (div.full.f32) unless TORCHINDUCTOR_EMULATE_DIVISION_ROUNDING=1
    s = np.maximum(amax * INV_448, MIN_SCALE)
    res["inductor_group_native"] = compare(x, q_ours, s_ours, quant(xg, s, "div"), s, near_midpoint(xg, s))
    # (4) dynamic per-token CUDA kernel: scale = max(amax / 448, min), q = x / scale (division);
    #     ours VLLM_TENSOR_NATIVE: x * reciprocal(scale)
    tamax = np.abs(x).max(axis=-1, keepdims=True)
    s_tok = np.maximum(tamax / FP8_MAX, MIN_SCALE)
    res["cuda_dynamic_per_token"] = compare(x, quant(x, s_tok, "recip"), s_tok, quant(x, s_tok, "div"), s_tok)
    # (5) static per-tensor scaled_fp8_quant (queries for FP8 attention, static input scales): x * (1.0f / s);
    #     ours (quantize_kv): x / s. Scales: (a) s = a / 448 for each of the 128 bfloat16 a in [4, 8) (an amax
    #     taken from bf16 data); (b) 64 scales s = amax * margin / 448, margin uniform in [1, 1.1) (a calibration
    #     from other data or with a margin: no structure). Reported: the worst scale, with mean / min.
    amax_t = np.abs(x).max()
    bf16_amax = (4.0 * (1.0 + np.arange(128) / 128.0)).astype(F32)
    margins = np.random.default_rng(1).uniform(1.0, 1.1, 64).astype(F32)
    for name, scales in (("cuda_static_per_tensor_bf16amax", [a / FP8_MAX for a in bf16_amax]),
                         ("cuda_static_per_tensor_margin", [F32(amax_t * m) / FP8_MAX for m in margins])):
        fr, worst = [], None
        for s_t in scales:
            r = compare(x, quant(x, s_t, "div"), s_t, quant(x, s_t, "recip"), s_t)
            fr.append(r["frac_codes"])
            worst = r if worst is None or r["frac_codes"] > worst["frac_codes"] else worst
        res[name] = dict(worst, frac_codes_mean=float(np.mean(fr)), frac_codes_min=float(np.min(fr)),
                         n_scales=len(fr))
    # (6) FP8 KV-cache write (reshape_and_cache_flash -> scaled_convert): x / k_scale, __NV_SATFINITE, RN;
    #     ours quantize_kv: x / k_scale -> identical by construction (checked anyway)
    s_t = F32(amax_t) / FP8_MAX
    res["cuda_kv_cache_write"] = compare(x, quant(x, s_t, "div"), s_t, quant(x, s_t, "div"), s_t)
    return res


def weight_rows(w: np.ndarray) -> dict:
    """per_block_cast_to_fp8 on CUDA (eager) vs VLLM_BLOCK_CAST (the same function on CPU), 128x128 blocks."""
    wb = block_view(w)
    amax = np.maximum(block_amax(w), F32(1e-4))
    s_ours = amax / FP8_MAX  # CPU: true division
    s_gpu = amax * INV_448  # CUDA: tensor / python float -> a * RN(1/b) (BinaryDivTrueKernel.cu)
    q_ours, q_gpu = quant(wb, s_ours, "recip"), quant(wb, s_gpu, "recip")
    return compare(w.reshape(wb.shape), q_ours, s_ours, q_gpu, s_gpu)


def scale_tables(rng: np.random.Generator) -> dict:
    """Scale-only statistics, exhaustive over bf16 amax values and sampled over float32 ones."""
    bf = np.arange(0x0080, 0x7F80, dtype=np.uint32)  # every positive normal finite bf16
    a_bf = (bf << 16).view(F32)
    a_f32 = np.exp2(rng.uniform(-20, 10, 1 << 20)).astype(F32)
    out = {}
    for name, a in (("bf16_all", a_bf), ("f32_sample", a_f32)):
        s_div, s_mul = a / FP8_MAX, a * INV_448
        t = np.maximum(np.maximum(a, F32(1e-10)) / FP8_MAX, F32(1e-10))  # both CUDA kernels floor at 1e-10
        lg = np.log2(t.astype(np.float64))
        frac = np.abs(lg - np.round(lg))
        out[name] = {
            "n": int(a.size),
            "frac_scale_div_vs_recip448": float((s_div != s_mul).mean()),
            "frac_ue8m0_bits_vs_torch": float((ue8m0_bits(t) != ue8m0_torch(t)).mean()),
            # how close log2(s) comes to an integer when s is not a power of two: a log2f error below this
            # cannot change ceil(log2f(s))
            "min_log2_distance_to_int": float(frac[frac > 0].min()),
        }
    return out


def check_jax(x: np.ndarray, w: np.ndarray) -> None:
    """The numpy references equal the project's quantizers bit for bit (activations, per token, KV, weights)."""
    import jax.numpy as jnp

    from fp8rl_jax.fp8 import formats
    from fp8rl_jax.fp8 import quant as fq
    from fp8rl_jax.fp8.kv_cache import quantize_kv

    xj = jnp.asarray(x, jnp.bfloat16)
    q, s = fq.quantize_activation_groupwise(xj)
    amax = group_amax(x)
    s_ref = np.maximum(amax / FP8_MAX, MIN_SCALE)
    assert np.array_equal(np.asarray(s), s_ref[..., 0]), "activation scales"
    assert np.array_equal(np.asarray(q).view(np.uint8).reshape(-1), quant(group_view(x), s_ref, "div").reshape(-1))
    q, s = fq.quantize_activation_groupwise(xj, recipe=formats.CONTRACT)  # = vLLM's CUDA group kernel
    s_ref = np.maximum(amax, F32(1e-10)) / FP8_MAX
    assert np.array_equal(np.asarray(q).view(np.uint8).reshape(-1), quant(group_view(x), s_ref, "div").reshape(-1))
    q, s = fq.quantize_activation_groupwise(xj, recipe=formats.VLLM_GROUP_TRITON)  # its scale, IEEE division
    s_ref = np.maximum(amax, F32(1e-10)) * INV_448
    assert np.array_equal(np.asarray(s), s_ref[..., 0]), "triton-recipe scales"
    q, s = fq.quantize_per_token(xj)
    s_ref = np.maximum(np.abs(x).max(axis=-1, keepdims=True) / FP8_MAX, MIN_SCALE)
    assert np.array_equal(np.asarray(q).view(np.uint8), quant(x, s_ref, "recip")), "per token"
    s_t = F32(np.abs(x).max()) / FP8_MAX
    assert np.array_equal(np.asarray(quantize_kv(xj, s_t)).view(np.uint8), quant(x, s_t, "div")), "kv"
    q, s = fq.quantize_weight_blockwise(jnp.asarray(w))
    amax = np.maximum(block_amax(w), F32(1e-4))
    assert np.array_equal(np.asarray(s), (amax / FP8_MAX)[:, 0, :, 0]), "weight scales"
    wq = quant(block_view(w), amax / FP8_MAX, "recip").reshape(w.shape)
    assert np.array_equal(np.asarray(q).view(np.uint8), wq), "weight codes"
    print("check-jax: numpy references == project quantizers (group native/CONTRACT/TRITON scale, per token, kv, "
          "weights)")


def fmt(r: dict) -> str:
    b = f" bound<={r['bound_frac_codes']:.2e}" if "bound_frac_codes" in r else ""
    extra = (f" (mean {r['frac_codes_mean']:.2e}, min {r['frac_codes_min']:.2e} over {r['n_scales']} scales)"
             if "frac_codes_mean" in r else "")
    return (f"codes {r['frac_codes']:.2e}{extra}{b} | max {r['max_code_steps']} step(s), rel {r['max_rel_value']:.2e}"
            f" | scales {r['frac_scales']:.2e} | vs FP8 err mean {r['vs_fp8_error']:.1e}"
            f" rms {r['rms_vs_fp8_error']:.1e}"
            f" (FP8 rel RMS "
            f"{r['fp8_rel_rms']:.3f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=1024, help="activation rows (K = 1024: 1M values, 8192 groups)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check-jax", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    t0 = time.time()
    result = {"activations": {}, "weights": {}}
    for kind in ("normal", "student_t3", "outlier_channels"):
        x = activations(kind, args.rows, 1024, rng)
        result["activations"][kind] = activation_rows(x)
        for name, r in result["activations"][kind].items():
            print(f"{kind:17s} {name:24s} {fmt(r)}")
    for kind, dt in (("normal0.02_f32", None), ("normal0.02_bf16", "bf16"), ("student_t3_0.02_bf16", "bf16")):
        base = rng.standard_t(3, (2048, 2048)) if "student" in kind else rng.standard_normal((2048, 2048))
        w = (0.02 * base).astype(F32)
        w = bf16_round(w) if dt else w
        result["weights"][kind] = r = weight_rows(w)
        print(f"{kind:17s} {'per_block_cast_to_fp8':24s} {fmt(r)}")
    result["scales"] = scale_tables(rng)
    for name, r in result["scales"].items():
        print(f"scales {name}: {r}")
    if args.check_jax:
        check_jax(activations("student_t3", 256, 1024, rng), (0.02 * rng.standard_normal((512, 768))).astype(F32))
    print(f"({time.time() - t0:.1f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
