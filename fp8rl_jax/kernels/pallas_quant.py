"""Pallas kernels for blockwise e4m3 quantization: weights (128x128 blocks) and activations (1x128 groups).

One pass over the input: each program loads one tile, reduces its absolute maximum, writes the fp8 values and
the float32 ``scale_inv``. Weights are batched: a stack ``[L, N, K]`` (all layers' weights of one shape) is
quantized by one ``pallas_call`` with grid ``(L, ceil(N/128), ceil(K/128))``.

Backends: where a program is lowered for CUDA the kernel is compiled with Triton (Pallas' default GPU lowering);
lowered for any other platform the ``"auto"`` dispatchers run the jnp reference of :mod:`fp8rl_jax.fp8.quant`
and an explicitly requested Pallas kernel runs with ``interpret=True`` (for tests at small sizes). The choice is
made per computation by :func:`fp8rl_jax.kernels.registry.choose` (``jax.lax.platform_dependent``), never by which
devices exist; the ``quant`` family's self-test and ``FP8RL_KERNELS`` apply. The kernel body calls the same scale/rounding helpers as the jnp reference
(:func:`~fp8rl_jax.fp8.formats.compute_scale`, :func:`~fp8rl_jax.fp8.formats.scale_values`), so in interpret
mode both are bit-identical (tested). On GPU, divisions are emitted as PTX ``div.rn.f32`` (Triton's own
float32 division is the approximate ``div.full.f32``), UE8M0 uses integer bit arithmetic, the e4m3 cast is
Triton's round-to-nearest convert, and NaN is mapped to +inf before the (NaN-ignoring) Triton max, so the GPU
kernel computes the same IEEE operations; that equality is checked on a GPU by tests/test_fp8_gpu.py against a
float64-numpy + ml_dtypes reference. Ragged shapes are zero-padded to whole tiles before the kernel
(:func:`padded_tile_shape`): no tile overhangs an array, so no load or store can go out of bounds.

:func:`quantize_weights_batched` is the dispatcher the exporter uses: it groups same-shaped weights, stacks
each group and quantizes it in one call (jnp lowered for the CPU, Pallas lowered for CUDA).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from fp8rl_jax.fp8.formats import (ACTIVATION_RECIPE, BLOCK_SIZE, E4M3, E4M3_MAX, WEIGHT_RECIPE, QuantRecipe,
                                   block_amax, compute_scale, scale_values)
from fp8rl_jax.kernels.registry import KernelMismatch, choose, register_selftest, run_pallas, use_kernel
from fp8rl_jax.fp8.quant import _block_pair, _quantize_blocks, _quantize_groups, _require, raise_if_nonfinite


def _quantize_3d_on_platform(x3, interpret: bool | None, **kw):
    """:func:`_pallas_quantize_3d` compiled as a GPU kernel where the program is lowered for CUDA and in interpret
    mode elsewhere (``interpret=None``), or as forced."""
    return run_pallas(_pallas_quantize_3d, x3, interpret=interpret, **kw)


def _quant_tile_kernel(x_ref, q_ref, s_ref, *, bn, bk, per_row, ue8m0, fp8_dtype, fp8_max, recipe, ptx):
    """One tile: ``x_ref`` (bn, bk) -> ``q_ref`` (bn, bk) fp8, ``s_ref`` (1, 1) or (bn, 1) float32.

    Every tile lies inside its arrays (:func:`padded_tile_shape`): no load or store needs a bounds mask."""
    xt = x_ref[...]
    x = xt.astype(jnp.float32)
    amax = block_amax(xt, 1, keepdims=True, ptx=ptx)  # (bn, 1)
    if not per_row:
        amax = jnp.max(amax, axis=0, keepdims=True)  # (1, 1)
    s = compute_scale(amax, fp8_max, ue8m0, recipe=recipe, ptx=ptx)
    q_ref[...] = scale_values(x, s, fp8_dtype, fp8_max, recipe=recipe, ptx=ptx)
    s_ref[...] = s


@functools.partial(jax.jit, static_argnames=("bn", "bk", "per_row", "ue8m0", "fp8_dtype", "fp8_max", "recipe",
                                             "interpret", "num_warps"))
def _pallas_quantize_3d(x, *, bn, bk, per_row, ue8m0, fp8_dtype, fp8_max, recipe, interpret, num_warps=4):
    lsz, n, k = x.shape
    n_pad, k_pad = padded_tile_shape(n, k, bn, bk)
    if (n_pad, k_pad) != (n, k):
        # Zero-pad ragged edges (the jnp reference's padding) instead of masking inside the kernel: Pallas'
        # Triton lowering adds no bounds check to plain ref loads and stores, so an edge tile hanging over the
        # array would read and write past its end on a GPU (interpret mode pads and slices, and hides that).
        x = jnp.pad(x, ((0, 0), (0, n_pad - n), (0, k_pad - k)))
        q, s = _pallas_quantize_3d(x, bn=bn, bk=bk, per_row=per_row, ue8m0=ue8m0, fp8_dtype=fp8_dtype,
                                   fp8_max=fp8_max, recipe=recipe, interpret=interpret, num_warps=num_warps)
        return q[:, :n, :k], (s[:, :n] if per_row else s)
    nb, kb = n // bn, k // bk
    ptx = not interpret
    kernel = functools.partial(_quant_tile_kernel, bn=bn, bk=bk, per_row=per_row, ue8m0=ue8m0,
                               fp8_dtype=fp8_dtype, fp8_max=fp8_max, recipe=recipe, ptx=ptx)
    tile = pl.BlockSpec((pl.squeezed, bn, bk), lambda l, i, j: (l, i, j))
    if per_row:
        s_spec = pl.BlockSpec((pl.squeezed, bn, 1), lambda l, i, j: (l, i, j))
        s_shape = (lsz, n, kb)
    else:
        s_spec = pl.BlockSpec((pl.squeezed, 1, 1), lambda l, i, j: (l, i, j))
        s_shape = (lsz, nb, kb)
    kwargs = {}
    if not interpret:
        from jax.experimental.pallas import triton as plgpu

        kwargs["compiler_params"] = plgpu.CompilerParams(num_warps=num_warps, num_stages=1)
    return pl.pallas_call(
        kernel,
        grid=(lsz, nb, kb),
        in_specs=[tile],
        out_specs=[tile, s_spec],
        out_shape=[jax.ShapeDtypeStruct((lsz, n, k), fp8_dtype), jax.ShapeDtypeStruct(s_shape, jnp.float32)],
        interpret=interpret,
        name="fp8_blockwise_quant",
        **kwargs,
    )(x)


def padded_tile_shape(n: int, k: int, bn: int, bk: int) -> tuple[int, int]:
    """``(N, K)`` rounded up to whole ``(bn, bk)`` tiles: the shape every quantization kernel runs on.

    Ragged inputs are zero-padded to it before the ``pallas_call`` and the outputs sliced back, so the grid
    ``(N_pad / bn, K_pad / bk)`` covers the arrays exactly and no tile overhangs an edge.
    """
    return -(-n // bn) * bn, -(-k // bk) * bk


def pallas_quantize_weight_blockwise(
    w: jnp.ndarray, block_size: tuple[int, int] | int = BLOCK_SIZE, ue8m0: bool = False, *, fp8_dtype=E4M3,
    fp8_max: float = E4M3_MAX, recipe: QuantRecipe | None = None, interpret: bool | None = None,
    check: bool = True,
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Pallas version of :func:`fp8rl_jax.fp8.quant.quantize_weight_blockwise` (same outputs, bit for bit).

    Args:
      w: ``[N, K]`` or a stack ``[L, N, K]`` (any float dtype; more leading dims are flattened into L).
      block_size: ``(bn, bk)`` or int (powers of two on GPU; default 128).
      ue8m0: power-of-two scales.
      fp8_dtype, fp8_max: target format.
      recipe: rounding details; default ``formats.WEIGHT_RECIPE`` (vLLM ``per_block_cast_to_fp8``).
      interpret: force interpret mode or the compiled kernel (default None: compiled where the program is lowered
        for CUDA, interpret mode elsewhere).
      check: when called eagerly, raise ``ValueError`` on NaN/inf input.

    Returns:
      ``(q [..., N, K] fp8, scale_inv [..., ceil(N/bn), ceil(K/bk)] float32)``.

    Raises:
      ValueError: fewer than 2 dims, non-float dtype, bad block size, or (eager, ``check``) NaN/inf.
    """
    _require("pallas_quantize_weight_blockwise", w, 2)
    bn, bk = _block_pair(block_size)
    *lead, n, k = w.shape
    x3 = w.reshape(-1, n, k)
    q, s = _quantize_3d_on_platform(x3, interpret, bn=bn, bk=bk, per_row=False, ue8m0=bool(ue8m0),
                                    fp8_dtype=jnp.dtype(fp8_dtype), fp8_max=float(fp8_max),
                                    recipe=recipe or WEIGHT_RECIPE)
    q, s = q.reshape(*lead, n, k), s.reshape(*lead, *s.shape[1:])
    if check:
        raise_if_nonfinite("pallas_quantize_weight_blockwise", w, s)
    return q, s


def pallas_quantize_activation_groupwise(
    x: jnp.ndarray, group_size: int = BLOCK_SIZE, ue8m0: bool = False, *, fp8_dtype=E4M3,
    fp8_max: float = E4M3_MAX, recipe: QuantRecipe | None = None, block_rows: int = 32,
    interpret: bool | None = None, check: bool = True,
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Pallas version of :func:`fp8rl_jax.fp8.quant.quantize_activation_groupwise` (1 x group_size groups).

    Args:
      x: ``[..., K]`` float array (leading dims flattened into rows).
      group_size: elements per group along K (128).
      ue8m0: power-of-two scales.
      recipe: rounding details; default ``formats.ACTIVATION_RECIPE`` (vLLM ``QuantFP8`` native group path).
      block_rows: rows per program (a power of two on GPU).
      interpret: force interpret mode or the compiled kernel (default None: compiled where the program is lowered
        for CUDA, interpret mode elsewhere).
      check: when called eagerly, raise ``ValueError`` on NaN/inf input.

    Returns:
      ``(q [..., K] fp8, scale_inv [..., ceil(K/group_size)] float32)``.
    """
    _require("pallas_quantize_activation_groupwise", x, 1)
    *lead, k = x.shape
    m = 1
    for d in lead:
        m *= d
    bm = max(1, min(block_rows, pl.next_power_of_2(max(m, 1))))
    q, s = _quantize_3d_on_platform(x.reshape(1, m, k), interpret, bn=bm, bk=int(group_size), per_row=True,
                                    ue8m0=bool(ue8m0), fp8_dtype=jnp.dtype(fp8_dtype), fp8_max=float(fp8_max),
                                    recipe=recipe or ACTIVATION_RECIPE)
    q, s = q.reshape(*lead, k), s.reshape(*lead, s.shape[-1])
    if check:
        raise_if_nonfinite("pallas_quantize_activation_groupwise", x, s)
    return q, s


def quantize_activation_groupwise_dispatch(x: jax.Array, group_size: int = BLOCK_SIZE, *, fp8_dtype=E4M3,
                                           fp8_max: float = E4M3_MAX,
                                           cuda: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """The input quantizer of the engine's FP8 linears and MoE experts: 1 x ``group_size`` groups, vLLM
    ``QuantFP8`` native rounding (``formats.ACTIVATION_RECIPE``), by :func:`fp8rl_jax.kernels.registry.choose`
    (family ``quant``): the Pallas kernel (:func:`pallas_quantize_activation_groupwise`, one launch) for e4m3
    where the program is lowered for CUDA and the ``quant`` self-test allows it, the jnp quantizer
    (:func:`fp8rl_jax.fp8.quant._quantize_groups`) elsewhere and for other formats. The ``quant`` self-test checks
    the kernel against the jnp quantizer on the CPU bit for bit (at 32-row and few-row blocks); the H200 run of
    2026-11-27 found the kernel bit-exact against the float64 reference. FP8 training's ``dot_general`` keeps the
    jnp quantizer.

    Why a kernel on CUDA: as XLA ops each quantization site is an amax reduction, the scale's and every value's
    float64 division and the cast, fusions that XLA:GPU's HLO passes (priority fusion, the simplification fixed
    point) work through at every site of every layer. As one custom call per site, the Qwen3-8B engine program
    (36 layers, deviceless sm_90a) compiles in 1.4x bf16's time instead of 2.0x (medians; issue 37 item 5;
    ``benchmarks/results/compile_stages_h100_36layers_quant_kernel.json``).

    Args:
      x: ``[..., K]`` float activations (leading dims flattened into rows).
      group_size: elements per group along K (128).
      fp8_dtype, fp8_max: target format.
      cuda: what the caller knows of the platform: None (nothing: ``choose`` stages both paths), True (the caller is
        itself the CUDA branch of a ``choose``: the kernel, or jnp where the ``quant`` family is off, without
        staging the other path again) or False (a portable path: jnp).

    Returns:
      ``(q [..., K] fp8_dtype, scale_inv [..., ceil(K / group_size)] float32)``.

    Raises:
      ValueError: a 0-d or non-float ``x``.
    """
    _require("quantize_activation_groupwise_dispatch", x, 1)
    kw = dict(group_size=int(group_size), fp8_dtype=jnp.dtype(fp8_dtype), fp8_max=float(fp8_max))

    def kernel(a):
        return pallas_quantize_activation_groupwise(a, interpret=False, check=False, **kw)

    def xla(a):
        return _quantize_groups(a, ue8m0=False, recipe=ACTIVATION_RECIPE, **kw)

    if kw["fp8_dtype"] != jnp.dtype(E4M3) or kw["fp8_max"] != E4M3_MAX:  # the self-test covers e4m3 only
        return xla(x)
    if cuda is None:
        return choose("quant", x, kernel=kernel, xla=xla)
    return kernel(x) if cuda and use_kernel("quant") else xla(x)


def _decode_quant_kernel(x_ref, q_ref, st_ref, *, fp8_dtype, fp8_max, recipe, ptx):
    """One 128-wide K group of ``br`` (padded) token rows: ``x_ref`` (br, 128) -> ``q_ref`` (br, 128) fp8 and
    ``st_ref`` (br,) float32, their part of that group's row of the transposed scales. The same operations as
    :func:`_quant_tile_kernel` per row."""
    xt = x_ref[...]
    amax = block_amax(xt, 1, ptx=ptx)  # (br,)
    s = compute_scale(amax, fp8_max, False, recipe=recipe, ptx=ptx)
    q_ref[...] = scale_values(xt.astype(jnp.float32), s[:, None], fp8_dtype, fp8_max, recipe=recipe, ptx=ptx)
    st_ref[...] = s


@functools.partial(jax.jit, static_argnames=("m_pad", "interpret"))
def _pallas_quantize_for_decode(x, *, m_pad, interpret):
    m, k = x.shape
    kb = -(-k // BLOCK_SIZE)
    # zero rows and columns up to whole tiles (XLA fuses the pad into the producer of x); every tile then lies
    # inside its arrays, as in _pallas_quantize_3d
    x = jnp.pad(x, ((0, m_pad - m), (0, kb * BLOCK_SIZE - k))) if (m_pad, kb * BLOCK_SIZE) != (m, k) else x
    kernel = functools.partial(_decode_quant_kernel, fp8_dtype=jnp.dtype(E4M3), fp8_max=E4M3_MAX,
                               recipe=ACTIVATION_RECIPE, ptx=not interpret)
    # rows per program: the largest power of two dividing m_pad, at most 32 (Triton's blocks are powers of two;
    # m_pad is a multiple of 8, so 24 or 40 tokens take blocks of 8 rows and no block overhangs an array)
    br = min(32, m_pad & -m_pad)
    kwargs = {}
    if not interpret:
        from jax.experimental.pallas import triton as plgpu

        kwargs["compiler_params"] = plgpu.CompilerParams(num_warps=4, num_stages=1)
    return pl.pallas_call(
        kernel,
        grid=(m_pad // br, kb),
        in_specs=[pl.BlockSpec((br, BLOCK_SIZE), lambda i, j: (i, j))],
        out_specs=[pl.BlockSpec((br, BLOCK_SIZE), lambda i, j: (i, j)),
                   pl.BlockSpec((pl.squeezed, br), lambda i, j: (j, i))],
        out_shape=[jax.ShapeDtypeStruct((m_pad, kb * BLOCK_SIZE), jnp.dtype(E4M3)),
                   jax.ShapeDtypeStruct((kb, m_pad), jnp.float32)],
        interpret=interpret,
        name="fp8_decode_operand_quant",
        **kwargs,
    )(x)


def _jnp_quantize_for_decode(x, m_pad: int):
    """The portable form of :func:`quantize_activation_for_decode`: the jnp quantizer, then zero padding and the
    scales' transpose as XLA ops."""
    m, k = x.shape
    kb = -(-k // BLOCK_SIZE)
    # the padded rows are quantized as the kernel quantizes them: zeros, with a zero row's scale
    q, s = _quantize_groups(jnp.pad(x, ((0, m_pad - m), (0, 0))), group_size=BLOCK_SIZE, ue8m0=False,
                            fp8_dtype=jnp.dtype(E4M3), fp8_max=E4M3_MAX, recipe=ACTIVATION_RECIPE)
    return jnp.pad(q, ((0, 0), (0, kb * BLOCK_SIZE - k))), s.T


def quantize_activation_for_decode(x: jax.Array, m_pad: int, *, cuda: bool | None = None,
                                   interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """The decode GEMM's input quantizer: ``M <= m_pad`` token rows, 1 x 128 e4m3 groups (vLLM ``QuantFP8`` native
    rounding, ``formats.ACTIVATION_RECIPE``: the values of :func:`quantize_activation_groupwise_dispatch`), written
    straight in the layout the swap-AB decode kernel reads (:func:`fp8rl_jax.kernels.decode_gemm_mgpu.
    decode_w8a8_partials_t`): the values zero-padded to ``m_pad`` rows and whole 128-column groups, the scales
    transposed. One launch where there were three (the quantizer, then XLA's pads of the values and of the
    transposed scales; issue 37 item 1).

    Args:
      x: ``[M, K]`` float activations (bf16 or float32), ``M <= m_pad``.
      m_pad: the kernel's token count (:func:`fp8rl_jax.kernels.decode_gemm_mgpu.padded_tokens`: a multiple of 8,
        at most 64).
      cuda: as :func:`quantize_activation_groupwise_dispatch`: True (the caller is the CUDA branch of a choice:
        the kernel where the ``quant`` family's self-test passed, else jnp), False (jnp), None (both staged,
        :func:`fp8rl_jax.kernels.registry.choose`).
      interpret: forces the kernel: True in Pallas' interpreter (tests on the CPU), False compiled (a CUDA
        lowering); overrides ``cuda``. None: ``cuda`` decides.

    Returns:
      ``(xq [m_pad, ceil(K/128)*128] e4m3, xs_t [ceil(K/128), m_pad] float32)``; rows ``M..m_pad`` hold zeros and
      the scale of a zero row (the floored amax over 448), which multiplies only zeros.

    Raises:
      ValueError: ``x`` not 2-D or not float, ``m_pad`` below ``M``, above 64 or not a multiple of 8.
    """
    _require("quantize_activation_for_decode", x, 2)
    m = x.shape[0]
    if not (m <= m_pad <= 64 and m_pad % 8 == 0):
        raise ValueError(f"quantize_activation_for_decode: m_pad must be a multiple of 8 in [M, 64] = [{m}, 64], "
                         f"got {m_pad}")

    def kernel(a):
        return _pallas_quantize_for_decode(a, m_pad=int(m_pad), interpret=False)

    def xla(a):
        return _jnp_quantize_for_decode(a, int(m_pad))

    if interpret is not None:  # forced: the interpreter, or the compiled kernel
        return _pallas_quantize_for_decode(x, m_pad=int(m_pad), interpret=bool(interpret))
    if cuda is None:
        return choose("quant", x, kernel=kernel, xla=xla)
    return kernel(x) if cuda and use_kernel("quant") else xla(x)


def _as_items(weights):
    if isinstance(weights, Mapping):
        return list(weights.items()), "mapping"
    if isinstance(weights, Sequence) and not isinstance(weights, (str, bytes)):
        return list(enumerate(weights)), "sequence"
    raise TypeError(f"quantize_weights_batched: expected a dict or a list of arrays, got {type(weights).__name__}")


def quantize_weights_batched(
    weights, block_size: tuple[int, int] | int = BLOCK_SIZE, ue8m0: bool = False, *,
    recipe: QuantRecipe | None = None, backend: str = "auto", check: bool = True, stack: bool = True,
):
    """Quantize many weights blockwise with one kernel call per distinct ``(shape, dtype)`` (or per weight).

    With ``stack=True`` (default) same-shaped 2-D weights (e.g. every layer's ``q_proj``) are stacked into
    ``[L, N, K]`` and quantized together: few kernel launches, at the price of one extra read + write of every
    stacked weight (the stack) and one more of its outputs (the per-weight slices). With ``stack=False`` every
    weight is quantized by its own call and nothing is copied: inside one ``jax.jit`` (the exporter's
    program) the calls cost no Python dispatch each, so this is the fast form there (measured on CPU by
    ``benchmarks/bench_weight_sync.py --export-variants``; on a GPU it trades the copies for one kernel launch
    per weight). An array that already is a stack (``[L, N, K]``, as a scan-over-layers model holds it) is always
    quantized as its own call without a copy. Results are bit-identical either way, and to calling
    :func:`~fp8rl_jax.fp8.quant.quantize_weight_blockwise` per tensor.

    Args:
      weights: ``{name: array}`` or a list of arrays; each ``[..., N, K]`` float (HF layout ``[out, in]``).
      block_size, ue8m0, recipe: as in :func:`~fp8rl_jax.fp8.quant.quantize_weight_blockwise`.
      backend: ``"auto"`` (Pallas where lowered for CUDA, jnp elsewhere: :func:`fp8rl_jax.kernels.registry.choose`),
        ``"jnp"``, ``"pallas"`` (interpret mode where not lowered for CUDA).
      check: raise ``ValueError`` naming the first tensor with NaN/inf (eager calls only).
      stack: stack same-shaped 2-D weights into one call (see above); ``False``: one call per weight, no copies.

    Returns:
      The same container type: ``{name: (q, scale_inv)}`` or ``[(q, scale_inv), ...]``.

    Raises:
      ValueError: unknown backend, a non-float or <2-d array, or (``check``) NaN/inf values.
      TypeError: ``weights`` is neither a mapping nor a sequence.
    """
    if backend not in ("auto", "jnp", "pallas"):
        raise ValueError(f"backend must be 'auto', 'jnp' or 'pallas', got {backend!r}")
    bn, bk = _block_pair(block_size)
    recipe = recipe or WEIGHT_RECIPE
    kw = dict(bn=bn, bk=bk, ue8m0=bool(ue8m0), fp8_dtype=jnp.dtype(E4M3), fp8_max=E4M3_MAX, recipe=recipe)
    items, kind = _as_items(weights)
    groups: dict[tuple, list] = {}
    for key, w in items:
        w = jnp.asarray(w)
        _require(f"quantize_weights_batched[{key!r}]", w, 2)
        # 2-D matrices of one shape are stacked (one copy, one call) unless ``stack=False``; an array that already
        # is a stack is quantized in place as its own call (stacking it again would cost a full extra read + write).
        gkey = ((tuple(w.shape), jnp.dtype(w.dtype)) if w.ndim == 2 and stack
                else ("alone", len(groups), key))
        groups.setdefault(gkey, []).append((key, w))
    out = {}
    for members in groups.values():
        shape = tuple(members[0][1].shape)
        if len(members) == 1:
            batch = members[0][1].reshape(-1, *shape[-2:])
        else:
            batch = jnp.stack([w for _, w in members])
        q, s = _quantize_stack(batch, backend, kw)
        if len(members) == 1:
            results = [(q.reshape(shape), s.reshape(*shape[:-2], *s.shape[-2:]))]
        else:
            results = [(q[i], s[i]) for i in range(len(members))]
        for (key, wi), (qi, si) in zip(members, results):
            if check:
                raise_if_nonfinite(f"quantize_weights_batched[{key!r}]", wi, si)
            out[key] = (qi, si)
    if kind == "mapping":
        return {key: out[key] for key, _ in items}
    return [out[i] for i in range(len(items))]


def _quantize_stack(batch, backend: str, kw: dict):
    """Blockwise quantization of a ``[L, N, K]`` stack by ``backend`` (``"auto"``: the Pallas kernel where the
    program is lowered for CUDA, jnp elsewhere, :func:`fp8rl_jax.kernels.registry.choose`; ``"pallas"``: the kernel,
    interpret mode off CUDA; ``"jnp"``)."""
    def jnp_path(b):
        return _quantize_blocks(b, **kw)

    if backend == "jnp":
        return jnp_path(batch)
    if backend == "pallas":
        return _quantize_3d_on_platform(batch, None, per_row=False, **kw)
    return choose("quant", batch, kernel=functools.partial(_pallas_quantize_3d, per_row=False, interpret=False, **kw),
                  xla=jnp_path)


def concat_rows(arrays) -> jax.Array:
    """``jnp.concatenate(arrays, axis=0)``; float8 arrays go through their uint8 bits (same bytes, same result).

    Why: XLA:CPU (jax 0.10.2) runs a concatenation of float8 values that is fused with its producers (the
    quantization) ~2.5x slower than the same loop on uint8 (measured on the fused export's e4m3 outputs:
    0.09 s vs 0.034 s for 4 x gate|up of 3072 x 1024); the bitcasts cost nothing.
    """
    dt = jnp.dtype(arrays[0].dtype)
    if dt.itemsize == 1 and jnp.issubdtype(dt, jnp.floating):
        bits = [jax.lax.bitcast_convert_type(a, jnp.uint8) for a in arrays]
        return jax.lax.bitcast_convert_type(jnp.concatenate(bits, axis=0), dt)
    return jnp.concatenate(arrays, axis=0)


def _quant_into_kernel(x_ref, q_in_ref, s_in_ref, q_ref, s_ref, **kw):
    """:func:`_quant_tile_kernel` with the aliased destination buffers as (unread) inputs: only this part's tiles
    of ``q_ref``/``s_ref`` are written; the other rows keep what the buffer held (the other parts)."""
    del q_in_ref, s_in_ref  # aliased to q_ref / s_ref; never loaded
    _quant_tile_kernel(x_ref, q_ref, s_ref, **kw)


@functools.partial(jax.jit, static_argnames=("row_block", "total_rows", "bn", "bk", "ue8m0", "recipe", "interpret",
                                             "num_warps"))
def _pallas_quantize_into(x, q_buf, s_buf, *, row_block, total_rows, bn, bk, ue8m0, recipe, interpret,
                          num_warps=4):
    """Quantize ``x [n, k]`` (whole tiles) into rows ``[row_block * bn, row_block * bn + n)`` of the fused buffers.

    ``q_buf [total_rows, k]`` e4m3 / ``s_buf [total_rows / bn, k / bk]`` float32 are aliased to the outputs
    (``input_output_aliases``), so the call writes only its own tiles, in place; with ``q_buf=None`` the outputs are
    fresh buffers whose other rows are left for the next parts' calls."""
    n, k = x.shape
    nb, kb = n // bn, k // bk
    kw = dict(bn=bn, bk=bk, per_row=False, ue8m0=ue8m0, fp8_dtype=jnp.dtype(E4M3), fp8_max=E4M3_MAX, recipe=recipe,
              ptx=not interpret)
    tile_in = pl.BlockSpec((bn, bk), lambda i, j: (i, j))
    tile_out = pl.BlockSpec((bn, bk), lambda i, j: (i + row_block, j))
    s_out = pl.BlockSpec((1, 1), lambda i, j: (i + row_block, j))
    out_shape = [jax.ShapeDtypeStruct((total_rows, k), jnp.dtype(E4M3)),
                 jax.ShapeDtypeStruct((total_rows // bn, kb), jnp.float32)]
    extra = {}
    if not interpret:
        from jax.experimental.pallas import triton as plgpu

        extra["compiler_params"] = plgpu.CompilerParams(num_warps=num_warps, num_stages=1)
    if q_buf is None:
        kernel, in_specs, args = functools.partial(_quant_tile_kernel, **kw), [tile_in], (x,)
    else:
        kernel, in_specs, args = functools.partial(_quant_into_kernel, **kw), [tile_in, tile_out, s_out], (x, q_buf, s_buf)
        extra["input_output_aliases"] = {1: 0, 2: 1}
    return pl.pallas_call(kernel, grid=(nb, kb), in_specs=in_specs, out_specs=[tile_out, s_out], out_shape=out_shape,
                          interpret=interpret, name="fp8_blockwise_quant_fused", **extra)(*args)


def quantize_weights_fused(parts, block_size: tuple[int, int] | int = BLOCK_SIZE, ue8m0: bool = False, *,
                           recipe: QuantRecipe | None = None, backend: str = "auto"):
    """Quantize the row concatenation of ``parts`` blockwise without materializing the concatenation.

    The result equals ``quantize_weight_blockwise(concatenate(parts))`` and the row concatenation of each part's
    own quantization, bit for bit (tested), because every part's rows are whole 128-row blocks: this is vLLM's
    fused ``qkv_proj`` / ``gate_up_proj`` weight and ``weight_scale_inv`` (``QKVParallelLinear`` /
    ``MergedColumnParallelLinear`` loading blockwise FP8 shards; :mod:`fp8rl_jax.models.fused`). The bytes written
    are those of quantizing the parts separately:

    - jnp (CPU): each part is quantized by :func:`~fp8rl_jax.fp8.quant.quantize_weight_blockwise`'s computation and
      the e4m3 results concatenated through their uint8 bits; XLA fuses the concatenation with the quantization
      (one loop fusion writes the fused buffer; no per-part buffer; checked on the compiled HLO by
      tests/test_fused_projections.py);
    - Pallas (CUDA): one ``pallas_call`` per part, as unfused, each writing its tiles into the same fused buffers
      (``input_output_aliases``), so no concatenation copy runs after the kernels.

    Args:
      parts: ``[N_i, K]`` float arrays (HF ``[out, in]``) with the same K, each ``N_i`` a multiple of the block
        height.
      block_size, ue8m0, recipe: as :func:`~fp8rl_jax.fp8.quant.quantize_weight_blockwise`.
      backend: ``"auto"`` (Pallas where lowered for CUDA, jnp elsewhere), ``"jnp"`` or ``"pallas"`` (interpret mode
        where not lowered for CUDA).

    Returns:
      ``(q [sum N_i, K] e4m3, scale_inv [sum N_i / bn, ceil(K / bk)] float32)``.

    Raises:
      ValueError: no parts, unknown backend, parts not 2-D float, different K, or an ``N_i`` not a multiple of
        the block height.
    """
    if backend not in ("auto", "jnp", "pallas"):
        raise ValueError(f"backend must be 'auto', 'jnp' or 'pallas', got {backend!r}")
    parts = [jnp.asarray(p) if not isinstance(p, jax.Array) else p for p in parts]
    if not parts:
        raise ValueError("quantize_weights_fused: no parts")
    bn, bk = _block_pair(block_size)
    for i, p in enumerate(parts):
        _require(f"quantize_weights_fused[{i}]", p, 2)
        if p.ndim != 2:
            raise ValueError(f"quantize_weights_fused: part {i} has shape {tuple(p.shape)}, expected [N, K]")
        if p.shape[0] % bn:
            raise ValueError(f"quantize_weights_fused: part {i} has {p.shape[0]} rows, not a multiple of {bn}: a "
                             "scale block would straddle two parts")
    if len({p.shape[1] for p in parts}) != 1:
        raise ValueError(f"quantize_weights_fused: parts have different K {[p.shape[1] for p in parts]}")
    recipe = recipe or WEIGHT_RECIPE
    parts = tuple(parts)

    def jnp_path(ps):
        qs = [_quantize_blocks(p, bn=bn, bk=bk, ue8m0=bool(ue8m0), fp8_dtype=jnp.dtype(E4M3), fp8_max=E4M3_MAX,
                               recipe=recipe) for p in ps]
        return concat_rows([q for q, _ in qs]), jnp.concatenate([s for _, s in qs], axis=0)

    def pallas_path(ps, interpret):
        k = ps[0].shape[1]
        _, k_pad = padded_tile_shape(bn, k, bn, bk)
        total = sum(p.shape[0] for p in ps)
        q = s = None
        row_block = 0
        for p in ps:
            if k_pad != k:  # ragged K: zero-pad to whole tiles, as the unfused kernel does (no tile overhangs)
                p = jnp.pad(p, ((0, 0), (0, k_pad - k)))
            q, s = _pallas_quantize_into(p, q, s, row_block=row_block, total_rows=total, bn=bn, bk=bk,
                                         ue8m0=bool(ue8m0), recipe=recipe, interpret=interpret)
            row_block += p.shape[0] // bn
        return (q[:, :k] if k_pad != k else q), s

    if backend == "jnp":
        return jnp_path(parts)
    kernel = functools.partial(pallas_path, interpret=False)
    if backend == "pallas":
        return run_pallas(pallas_path, parts)
    return choose("quant", parts, kernel=kernel, xla=jnp_path)


def _selftest_quant() -> None:
    """Self-test of the ``quant`` family (:mod:`fp8rl_jax.kernels.registry`): the compiled kernel on the default (CUDA)
    device against the jnp quantizer on the CPU (bit-exact against the numpy and vLLM references there), for
    ragged bf16/float32 weights (128x128 blocks) and activations (1x128 groups), bit for bit.

    Raises:
      KernelMismatch: values or scales differ (counts in the message).
    """
    import numpy as np

    cpu = jax.devices("cpu")[0]
    rng = np.random.default_rng(0)
    # activations: 32-row blocks (prefill) and a decode batch of 3 rows (4-row blocks, one padded), as
    # pallas_quantize_activation_groupwise picks them
    cases = [((2, 200, 300), jnp.bfloat16, False), ((1, 130, 257), jnp.float32, False), ((1, 70, 300), jnp.bfloat16, True),
             ((1, 3, 300), jnp.bfloat16, True)]
    for shape, dtype, per_row in cases:
        w = rng.standard_normal(shape).astype(np.float32) * np.logspace(-3, 2, shape[-1], dtype=np.float32)
        x = jnp.asarray(w, dtype)
        recipe = ACTIVATION_RECIPE if per_row else WEIGHT_RECIPE
        bn = min(32, pl.next_power_of_2(shape[1])) if per_row else 128
        q, s = _pallas_quantize_3d(x, bn=bn, bk=128, per_row=per_row, ue8m0=False, fp8_dtype=jnp.dtype(E4M3),
                                   fp8_max=E4M3_MAX, recipe=recipe, interpret=False)
        xc = jax.device_put(np.asarray(x), cpu)
        if per_row:
            rq, rs = _quantize_groups(xc, group_size=128, ue8m0=False, fp8_dtype=jnp.dtype(E4M3), fp8_max=E4M3_MAX,
                                      recipe=recipe)
        else:
            rq, rs = _quantize_blocks(xc, bn=128, bk=128, ue8m0=False, fp8_dtype=jnp.dtype(E4M3), fp8_max=E4M3_MAX,
                                      recipe=recipe)
        dq = int(np.sum(np.asarray(q).view(np.uint8) != np.asarray(rq).view(np.uint8)))
        ds = int(np.sum(np.asarray(s).reshape(-1) != np.asarray(rs).reshape(-1)))
        if dq or ds:
            raise KernelMismatch(f"{'activation' if per_row else 'weight'} {shape} {jnp.dtype(dtype).name}: {dq} of "
                                 f"{q.size} e4m3 values and {ds} of {s.size} scales differ from the reference")
    # the decode GEMM's operand quantizer: 20 tokens padded to 24 (three 8-row blocks), ragged K (its layout: padded
    # values, transposed scales), against the jnp quantizer's values padded and transposed on the CPU
    w = rng.standard_normal((20, 300)).astype(np.float32) * np.logspace(-3, 2, 300, dtype=np.float32)
    x = jnp.asarray(w, jnp.bfloat16)
    q, st = _pallas_quantize_for_decode(x, m_pad=24, interpret=False)
    rq, rst = _jnp_quantize_for_decode(jax.device_put(np.asarray(x), cpu), 24)
    dq = int(np.sum(np.asarray(q).view(np.uint8) != np.asarray(rq).view(np.uint8)))
    ds = int(np.sum(np.asarray(st) != np.asarray(rst)))
    if dq or ds or q.shape != rq.shape or st.shape != rst.shape:
        raise KernelMismatch(f"decode operand quantizer (20, 300) bfloat16 -> {tuple(q.shape)}, {tuple(st.shape)}: "
                             f"{dq} e4m3 values and {ds} scales differ from the reference")


register_selftest("quant", _selftest_quant)


def main(argv=None) -> None:
    """Time the quantization kernels against XLA's jnp quantizers (:mod:`fp8rl_jax.fp8.quant`, the same numerics) at
    Qwen3-8B shapes: the activations of a prefill (``--m`` rows x 4096 and x 12288, 1 x 128 groups) and the weights
    (gate/up 24576 x 4096 and down 12288 x 4096, 128 x 128 blocks; the per-step export), as microseconds and GB/s of
    bf16 read + e4m3 written. On a GPU; ``--smoke`` runs tiny shapes in interpret mode on the CPU (numbers
    meaningless).

    Raises:
      SystemExit: bad flags (argparse).
    """
    import numpy as np

    from fp8rl_jax.fp8 import quant
    from fp8rl_jax.kernels.timing import main_parser, per_call_us, print_table

    p = main_parser("pallas_quant", main.__doc__, iters=20)
    p.add_argument("--m", type=int, default=4096)
    args = p.parse_args(argv)
    if args.smoke:
        cases = (("activations", (64, 256)), ("weights", (256, 256)))
        iters = 1
    else:
        cases = (("activations", (args.m, 4096)), ("activations", (args.m, 12288)), ("weights", (24576, 4096)),
                 ("weights", (4096, 12288)))
        iters = args.iters
    rng = np.random.default_rng(0)
    rows = []
    for kind, shape in cases:
        x = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
        if kind == "activations":
            kernel = functools.partial(pallas_quantize_activation_groupwise, interpret=args.smoke, check=False)
            xla = functools.partial(quant.quantize_activation_groupwise, check=False)
        else:
            kernel = functools.partial(pallas_quantize_weight_blockwise, interpret=args.smoke, check=False)
            xla = functools.partial(quant.quantize_weight_blockwise, check=False)
        gb = x.size * 3 / 1e9  # bf16 read + e4m3 written (scales are 1/128 or 1/16384 of it)
        k_us, x_us = per_call_us(kernel, (x,), iters), per_call_us(xla, (x,), iters)
        rows.append((kind, "x".join(map(str, shape)), k_us, gb / k_us * 1e6, x_us, gb / x_us * 1e6, x_us / k_us))
    print_table("FP8 quantization kernels vs XLA's jnp quantizers", ("what", "shape", "kernel us", "kernel GB/s", "xla us", "xla GB/s", "kernel speedup"), rows)


if __name__ == "__main__":  # pragma: no cover
    main()
