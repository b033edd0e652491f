"""Per-step weight export in checkpoint layout (HF/vLLM names), FP8 blockwise or dense.

``export_weights`` turns the trainer's HF-named params into :class:`ExportedWeights`: every linear weight of a
decoder layer (``q/k/v/o_proj``, ``gate/up/down_proj``) becomes e4m3 ``weight`` ``[out, in]`` plus float32
``weight_scale_inv`` ``[ceil(out/128), ceil(in/128)]`` (vLLM's blockwise FP8 checkpoint format, as in
DeepSeek-V3 / Qwen3-FP8 checkpoints); embeddings, norms, biases and ``lm_head`` stay in bf16
(verl/vLLM keep them unquantized). The whole export is one jitted XLA program: each linear weight is quantized
by its own :func:`fp8rl_jax.fp8.quantize_weights_batched` call inside it (a Pallas kernel on GPU; no stacking
copies), bit-identical to quantizing them one at a time, and the program also returns one finiteness flag per
tensor, so the NaN/inf check costs no extra pass over the weights and one small host read.

With ``kv_scales`` the per-layer FP8 attention scales ride along under vLLM's checkpoint names
``model.layers.{i}.self_attn.{k,v,q}_scale`` (float32 scalars; vLLM's loader maps them to
``...self_attn.attn.{k,v,q}_scale``), tagged with ``metadata["kv_scales_version"]``.

With ``fuse=True`` (the embedded FP8 engine's sync, issue 21) the q/k/v and dense gate/up weights whose parts are
128-row aligned come out fused under vLLM's names (``self_attn.qkv_proj``, ``mlp.gate_up_proj``;
:mod:`fp8rl_jax.models.fused`), quantized inside the same program straight into the fused buffers
(:func:`fp8rl_jax.kernels.pallas_quant.quantize_weights_fused`): the same bytes written as the unfused export, no
concatenation pass afterwards, and the engine installs them without a copy. The default stays unfused: the HF
checkpoint names every other consumer (vLLM, torch receivers, HF export) reads.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fp8rl_jax.fp8 import BLOCK_SIZE, quantize_weights_batched
from fp8rl_jax.fp8.kv_cache import KVScales
from fp8rl_jax.export_ep import leading_axis_sharded, split_stack_on_owners
from fp8rl_jax.kernels.pallas_quant import quantize_weights_fused
from fp8rl_jax.models.experts import expert_names, is_expert_stack_name, split_expert_names, split_expert_stacks
from fp8rl_jax.models.fused import FusedProjection, fuse_tensors, fused_names, fused_projections
from fp8rl_jax.rollout.types import ExportedWeights

EXPORT_FORMATS = ("fp8_blockwise", "bf16", "float32")
_LINEAR = re.compile(r"^model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj"
                     r"|mlp\.(experts\.(\d+\.)?)?(gate|up|down)_proj)\.weight$")


def is_quantized_linear(name: str) -> bool:
    """True for the decoder-layer linear weights that FP8 export quantizes (HF names).

    Attention projections, dense MLP projections and Qwen3-MoE expert projections
    (``model.layers.{i}.mlp.experts.{j}.{gate,up,down}_proj.weight``, vLLM's per-expert checkpoint names) are
    quantized; the MoE router ``mlp.gate.weight``, embeddings, norms and ``lm_head`` are not (verl keeps the
    router in its FP8 ``ignored_layers``). The model's stacked expert names
    (``model.layers.{i}.mlp.experts.{gate,up,down}_proj.weight`` ``[E, N, K]``, :mod:`fp8rl_jax.models.experts`)
    count too: each slice is quantized as its expert.
    """
    return bool(_LINEAR.match(name))


def _in_modules(name: str, modules) -> bool:
    return any(name == m + ".weight" or name.startswith(m + ".") for m in modules)


def _nan_code_present(q: jax.Array) -> jax.Array:
    """bool scalar: does the e4m3 array ``q`` hold a NaN code (``0x7F``/``0xFF``)?

    The quantizer maps every non-finite input to NaN and nothing else to it (``cast_to_e4m3`` saturates finite
    values at 448 = ``0x7E``; NaN -> NaN; an inf makes its block's scale inf, so ``inf * (1/inf)`` is NaN), so
    this is exactly "the weight held NaN or inf". It reads the 1-byte output, not the weight again. The scale
    alone would not do on CPU: XLA CPU's vectorized max/min drop NaN depending on its position (a NaN was
    missed in 140 of 320 random placements, measured with jax 0.10.2).
    """
    # the barrier makes XLA reduce the stored q instead of fusing (re-running) the whole quantization into the
    # reduction. Cost on CPU (Qwen3-0.6B shapes, loaded 2-core Xeon, /tmp profile, not a benchmark): these flags
    # still add ~0.3 s (linears) + ~1 s (dense tensors, mostly the 622 MB float32 embedding) to a ~0.9 s
    # quantization: about what the old separate finiteness pass cost. Making them cheap is open (issue 18).
    b = lax.bitcast_convert_type(lax.optimization_barrier(q), jnp.uint8)
    return jnp.max(b & jnp.uint8(0x7F)) == jnp.uint8(0x7F)


_EXP_MASK = {2: (jnp.uint16, 0x7F80), 4: (jnp.uint32, 0x7F800000)}


def _nonfinite_present(w: jax.Array) -> jax.Array:
    """bool scalar: does the float array ``w`` hold NaN/inf? Exact: an all-ones exponent field, found by an integer
    max over the bits (bf16 and float32; other dtypes: ``isfinite``)."""
    w = jnp.asarray(w)
    if w.dtype.itemsize not in _EXP_MASK or not jnp.issubdtype(w.dtype, jnp.floating) or w.size == 0:
        return ~jnp.all(jnp.isfinite(w))
    ut, mask = _EXP_MASK[w.dtype.itemsize]
    return jnp.max(lax.bitcast_convert_type(w, ut) & ut(mask)) == ut(mask)



def _source_names(params, fused: tuple[FusedProjection, ...], keep_stacks: bool = False) -> list[str]:
    """The export's tensor names before ``_scale_inv`` (``sorted``): the names of ``params`` with stacked experts
    as their per-expert HF names and each fused group's part tensors replaced by the fused ones; the order of
    :func:`_export`'s ``bad`` flags. With ``keep_stacks`` the expert stacks keep their stacked names."""
    shapes = {k: tuple(v.shape) for k, v in params.items()}
    return fused_names(sorted(shapes) if keep_stacks else split_expert_names(shapes), fused)


def _split_mixed_stacks(params: dict, unquantized: tuple) -> dict:
    """Stacked experts that ``unquantized`` names only in part (per-expert modules) as per-expert slices; the rest
    as they are (a stack is then quantized, or kept dense, whole)."""
    mixed = {}
    for name, w in params.items():
        if is_expert_stack_name(name) and not _in_modules(name, unquantized):
            if any(_in_modules(n, unquantized) for n in expert_names(name, w.shape[0])):
                mixed[name] = w
    if not mixed:
        return params
    out = {k: v for k, v in params.items() if k not in mixed}
    out.update(split_expert_stacks(mixed))
    return out


@functools.partial(jax.jit, static_argnames=("fmt", "block_size", "ue8m0", "unquantized", "check", "stack",
                                             "fused", "keep_stacks"))
def _export(params: dict, fmt: str, block_size: int, ue8m0: bool, unquantized: tuple = (), check: bool = True,
            stack: bool = False, fused: tuple = (), keep_stacks: bool = False):
    """The whole export as one XLA program: ``({name: array}, bad)``.

    ``bad`` is a bool ``[len(names)]`` in :func:`_source_names` order (True: that tensor holds NaN/inf), or None
    without ``check``. Linears are quantized one call per weight (``stack=False``, no stack/slice copies; see
    :func:`fp8rl_jax.fp8.quantize_weights_batched`), each fused group (``fused``) by one
    :func:`~fp8rl_jax.kernels.pallas_quant.quantize_weights_fused` call that writes the fused buffers directly; their
    finiteness comes from the quantized output and the scales (the GPU Pallas kernel propagates NaN into the scales), dense tensors' (a fused group's biases: concatenated) from an ``isfinite`` reduction
    fused with their cast. ``keep_stacks``: expert stacks leave as stacks (one tensor, one flag each).
    """
    out, bad = {}, []
    dense = jnp.float32 if fmt == "float32" else jnp.bfloat16
    quantized = {}
    in_group = {f"{p}.weight" for g in fused for p in g.parts}
    params = _split_mixed_stacks(params, unquantized)
    if fmt == "fp8_blockwise":
        linears = {name: w for name, w in params.items()
                   if is_quantized_linear(name) and not _in_modules(name, unquantized) and name not in in_group}
        quantized = (quantize_weights_batched(linears, block_size, ue8m0, check=False, stack=stack)
                     if linears else {})
        # a stacked expert projection [E, N, K] is quantized as one call (bit-identical per expert), then exported
        # from `quantized` only: as the stack (keep_stacks), else per expert under the HF names
        stacks = [n for n in quantized if is_expert_stack_name(n)]
        params = {k: v for k, v in params.items() if k not in stacks}
        for n in stacks if not keep_stacks else ():
            q, sc = quantized.pop(n)
            quantized.update({name: (q[j], sc[j]) for j, name in enumerate(expert_names(n, q.shape[0]))})
        for g in fused:
            quantized[f"{g.name}.weight"] = quantize_weights_fused([params[f"{p}.weight"] for p in g.parts],
                                                                   block_size, ue8m0)
    if not keep_stacks:
        params = split_expert_stacks(params)  # dense expert stacks (bf16/float32 export): per-expert slices
    if fused:  # the groups' other tensors (Qwen2 biases) are concatenated under the fused names, then cast
        params = fuse_tensors({k: v for k, v in params.items() if k not in in_group}, fused)
    for name in sorted(set(params) | set(quantized)):
        w = params.get(name)
        if name in quantized:
            q, s = quantized[name]
            out[name], out[name + "_scale_inv"] = q, s
            if check:
                # jnp path: a NaN/inf input leaves a NaN code; the Pallas kernel (lowered for CUDA) maps NaN to inf
                # before its block max (a non-finite scale) and may clamp NaN values: either flag is enough
                bad.append(_nan_code_present(q) | ~jnp.all(jnp.isfinite(s)))
        else:
            out[name] = w.astype(dense)
            if check:
                bad.append(_nonfinite_present(w))
    return out, (jnp.stack(bad) if bad else None)


def export_weights(params: dict, fmt: str = "fp8_blockwise", *, block_size: int = BLOCK_SIZE, ue8m0: bool = False,
                   version: int = 0, check_finite: bool = True, kv_scales: KVScales | None = None,
                   kv_scales_version: int | None = None, unquantized=(), fuse: bool = False,
                   expert_stacks: bool = False) -> ExportedWeights:
    """Export HF-named params for a rollout engine.

    One compiled XLA program per (names, shapes, dtypes, options), cached by ``jax.jit``: every linear is
    quantized by its own call inside it (no stacking copies), dense tensors are cast, and the finiteness of every
    tensor is computed in the same program (a bool per tensor), so the whole export is one dispatch plus, with
    ``check_finite``, one small host read of those flags (which waits for the program; a sender waits for it
    anyway before handing the buffers on).

    Args:
      params: ``{hf_name: array}`` (the trainer's float32/bf16 params, e.g. ``named_params(model)``). Qwen3-MoE
        experts may come per expert (HF names) or as the model's stacks (``...mlp.experts.gate_proj.weight``
        ``[E, N, K]``, what :class:`ModelParamsReader` returns): a stack is quantized by one call inside the
        program and exported per expert under the HF names, bit-identical to exporting its slices.
      fmt: ``"fp8_blockwise"`` | ``"bf16"`` | ``"float32"``.
      block_size: FP8 weight block edge (128).
      ue8m0: power-of-two scales.
      version: weights version recorded in the result (the trainer step).
      check_finite: refuse to export NaN/inf weights (names the bad tensors). Judged inside the export program:
        for a quantized linear from its e4m3 output (a NaN code appears exactly where the weight held NaN/inf),
        for a dense tensor from an ``isfinite`` reduction. Skipped when traced (``jax.eval_shape``/``jit``).
      kv_scales: per-layer FP8 KV-cache / attention scales (:class:`fp8rl_jax.fp8.kv_cache.KVScales`) to ship
        with the weights as ``model.layers.{i}.self_attn.{k,v,q}_scale`` float32 scalars.
      kv_scales_version: the weights version the scales were calibrated for (default ``version``); an engine
        refuses to generate from an FP8 cache whose scales are older than its weights.
      unquantized: module names (``model.layers.3.self_attn.k_proj``, or a prefix such as
        ``model.layers.3.mlp.experts``) whose linear weights stay bf16 under ``fp8_blockwise``, with
        no ``weight_scale_inv`` (see :func:`fp8_unloadable_linears`).
      fuse: ``fp8_blockwise`` only (ignored for dense formats, which the bf16/float32 engines run unfused): export
        every q/k/v and dense gate/up group whose parts are ``block_size``-row aligned and quantized
        (:func:`fp8rl_jax.models.fused.fused_projections`; a group touching ``unquantized`` stays unfused) as one
        fused tensor under vLLM's names, ``model.layers.{i}.self_attn.qkv_proj.{weight, weight_scale_inv, bias}``
        (rows ``[q; k; v]``) and ``model.layers.{i}.mlp.gate_up_proj.{weight, weight_scale_inv}`` (rows
        ``[gate; up]``), bit-identical to the row concatenation of the unfused tensors and written in place by the
        quantization (no extra pass). ``metadata["fused_projections"]`` then lists the fused module names. For the
        embedded FP8 engine (:class:`fp8rl_jax.rollout.engine.JaxRolloutEngine`), not for vLLM (whose loader maps
        the HF shard names itself).
      expert_stacks: export Qwen3-MoE expert stacks given as stacks (``...mlp.experts.gate_proj.weight``
        ``[E, N, K]`` + ``weight_scale_inv [E, ceil(N/128), ceil(K/128)]``) under the stacked names, as the embedded
        engine stores them, instead of per expert: no split into E tensors here and no restacking copy in
        :meth:`~fp8rl_jax.rollout.engine.JaxRolloutEngine.update_weights`; each expert's slice is bit-identical to
        its per-expert export. ``metadata["expert_stacks"]`` is then True. For the embedded engine only (vLLM loads
        the per-expert HF names). A stack that ``unquantized`` names only in part is exported per expert anyway.

    Returns:
      :class:`ExportedWeights` (device arrays; no host copy), ``tensors`` in sorted name order.

    Raises:
      ValueError: unknown ``fmt``, or a non-finite weight (the first five bad names; fused names when fused).
    """
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; expected one of {EXPORT_FORMATS}")
    params = dict(params)
    unq = tuple(sorted(unquantized))
    fused: tuple[FusedProjection, ...] = ()
    if fuse and fmt == "fp8_blockwise":
        fused = fused_projections({k: tuple(v.shape) for k, v in params.items()}, block_size, exclude=unq)
    # expert-parallel stacks (sharded on their expert axis) leave the program as stacks and are split per expert on
    # their owners (fp8rl_jax.export_ep): an in-program slice would be a masked all-reduce, which also turns e4m3 -0
    # into +0
    owner_split = not expert_stacks and any(is_expert_stack_name(k) and leading_axis_sharded(v)
                                            for k, v in params.items())
    keep = bool(expert_stacks) or owner_split
    tensors, bad = _export(params, fmt, block_size, ue8m0, unq, bool(check_finite), fused=fused, keep_stacks=keep)
    if owner_split:
        split = {}
        for k, v in tensors.items():
            split.update(split_stack_on_owners(k, v) if is_expert_stack_name(k) else {k: v})
        tensors = {k: split[k] for k in sorted(split)}
    if check_finite and bad is not None and not isinstance(bad, jax.core.Tracer):
        flags = np.asarray(jax.device_get(bad))
        if flags.any():
            names = _source_names(_split_mixed_stacks(params, unq), fused, keep)
            raise ValueError(f"refusing to export non-finite weights: {[names[i] for i in np.flatnonzero(flags)[:5]]} "
                             "contain NaN or inf")
    metadata = {"ue8m0": ue8m0}
    if expert_stacks and any(is_expert_stack_name(k) for k in tensors):
        metadata["expert_stacks"] = True
    if fused:
        metadata["fused_projections"] = tuple(g.name for g in fused)
    if kv_scales is not None:
        scale_tensors = kv_scales.to_tensors()
        clash = sorted(set(scale_tensors) & set(tensors))
        if clash:
            raise ValueError(f"kv scale names clash with params: {clash[:5]}")
        tensors.update({k: jnp.asarray(v, jnp.float32) for k, v in scale_tensors.items()})
        metadata["kv_scales_version"] = int(version if kv_scales_version is None else kv_scales_version)
    return ExportedWeights(tensors=tensors, format=fmt, block_size=block_size, version=version,
                           metadata=metadata)


class ModelParamsReader:
    """``{name: array}`` of an NNX model without walking its graph on every call.

    The graph walk (``nnx.state(model, nnx.Param)`` + flattening, what
    :func:`fp8rl_jax.models.decoder.named_params` does) runs once, here; a call reads the current value of each
    ``nnx.Variable`` found then. NNX updates parameters in place (``nnx.jit``/``nnx.Optimizer.update``,
    ``nnx.update``, ``var[...] = x``: the checkpoint restore and ``load_named_params`` paths), so the Variables stay
    the model's own and a read always sees the latest values (tested). Build a new reader if the model's structure
    is changed (a module or Variable replaced by a new object).

    Args:
      model: an NNX module with HF-named parameters (:class:`fp8rl_jax.models.decoder.CausalLM`).

    Names are the NNX state paths: the HF names, except that a Qwen3-MoE layer's experts come as the model's live
    stacks (``model.layers.{i}.mlp.experts.gate_proj.weight [E, I, H]``, :mod:`fp8rl_jax.models.experts`), not as
    per-expert copies; :func:`export_weights` takes them as they are and exports per-expert HF names, and
    :func:`fp8rl_jax.models.experts.split_expert_stacks` gives :func:`~fp8rl_jax.models.decoder.named_params`'
    naming.

    Attributes:
      model: the model read. names: the state names, in the walk's order.
    """

    def __init__(self, model):
        from flax import nnx

        from fp8rl_jax.models.decoder import param_name

        self.model = model
        self._vars = [(param_name(p), v) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))]
        self.names = [n for n, _ in self._vars]

    def __call__(self) -> dict[str, jax.Array]:
        """The live arrays (no copies): ``named_params(model)`` with expert stacks unsplit."""
        return {n: v[...] for n, v in self._vars}


# --- which FP8 linears the standard loaders can read as 128x128 blockwise FP8 ------------------------------------

# vLLM loads these checkpoint shards into one fused layer (``qkv_proj``, ``gate_up_proj``; MoE experts into one
# ``FusedMoE`` per layer) and gives a fused layer a single precision.
VLLM_FUSED_SHARDS = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
                     "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}
_SHARD_ORDER = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")


def vllm_shard_alignment_problem(name: str, shape, block_size: int = BLOCK_SIZE) -> str | None:
    """vLLM's rule for one FP8 linear weight: a fused shard's output rows must be a multiple of ``block_size``.

    vLLM fuses ``q/k/v_proj`` into ``qkv_proj`` and ``gate/up_proj`` into ``gate_up_proj`` (MoE experts' gate/up into
    ``w13``); the fused ``weight_scale_inv`` has ``ceil(N_total/128)`` rows, which equals the per-shard block rows
    only when every shard's N is a multiple of 128, so vLLM's ``BlockQuantScaleParameter`` loader fails otherwise
    (``validate_fp8_block_shape`` in vLLM 0.32 lets the last shard be ragged at tensor-parallel size 1; this rule
    does not, so a checkpoint that passes loads at any TP size whose per-rank shards stay 128-aligned).

    Args:
      name: HF weight name (``model.layers.{i}.self_attn.k_proj.weight``).
      shape: its ``[out, in]`` shape.
      block_size: FP8 weight block edge.

    Returns:
      ``"k_proj has 192 output rows, not a multiple of 128"`` or None (not a fused shard, or aligned).
    """
    proj = name.rsplit(".", 2)[-2] if name.endswith(".weight") else name.rsplit(".", 1)[-1]
    if proj in VLLM_FUSED_SHARDS and int(shape[0]) % block_size:
        return f"{proj} has {int(shape[0])} output rows, not a multiple of {block_size}"
    return None


def transformers_block_grid_problem(shape, block_size: int = BLOCK_SIZE) -> str | None:
    """transformers' rule for one FP8 linear weight: every dim a multiple of ``block_size`` or at most it.

    ``transformers`` (5.x) ``Fp8Dequantize`` (``integrations/finegrained_fp8.py``, the path it takes on CPU and on
    GPUs below sm_89, where it sets ``dequantize=True``) derives the block edge from the scale grid:
    ``block = dim // ceil(dim/128)``. It raises ``Weight shape (192, 576) not divisible by scale grid (2, 5)``
    when that division is not exact, and silently uses 96-row blocks where it is (192 rows, 2 grid rows), so a
    dim above 128 that is not a multiple of 128 cannot be read correctly; a dim up to 128 is one block.

    Returns:
      ``"dim 576 is neither a multiple of 128 nor <= 128"`` (the first offending dim) or None.
    """
    for d in shape:
        if int(d) > block_size and int(d) % block_size:
            return f"dim {int(d)} is neither a multiple of {block_size} nor <= {block_size}"
    return None


def fp8_block_alignment_problems(cfg, block_size: int = BLOCK_SIZE) -> list[str]:
    """Fused linear shards of an architecture that vLLM cannot load as blockwise FP8 (one message per projection).

    The rule is :func:`vllm_shard_alignment_problem` applied to :func:`fp8rl_jax.models.config.hf_param_shapes`
    (dense MLPs and Qwen3-MoE experts alike). Real FP8 checkpoints (DeepSeek-V3, Qwen3-FP8) satisfy it; e.g.
    SmolLM2-135M (k_proj 192 rows) does not.

    Args:
      cfg: :class:`fp8rl_jax.models.config.ModelConfig`.
      block_size: FP8 weight block edge.

    Returns:
      human-readable problems in ``q/k/v/gate/up`` order (empty when the architecture can be served as a
      blockwise FP8 checkpoint by vLLM).
    """
    from fp8rl_jax.models.config import hf_param_shapes

    found: dict[str, str] = {}
    for name, shape in hf_param_shapes(cfg).items():
        if is_quantized_linear(name):
            msg = vllm_shard_alignment_problem(name, shape, block_size)
            if msg:
                found.setdefault(msg.split()[0], msg)
    return [found[p] for p in _SHARD_ORDER if p in found]


def _fused_group(module: str) -> str:
    """The vLLM layer a checkpoint module loads into (``...self_attn.qkv_proj``, ``...mlp.experts``, or itself)."""
    m = re.match(r"^(model\.layers\.\d+\.mlp\.experts)\.\d+\.", module)
    if m:
        return m.group(1)
    parent, proj = module.rsplit(".", 1)
    return f"{parent}.{VLLM_FUSED_SHARDS[proj]}" if proj in VLLM_FUSED_SHARDS else module


def fp8_unloadable_linears(shapes, block_size: int = BLOCK_SIZE) -> dict[str, str]:
    """The FP8-eligible linears that must stay unquantized for transformers and vLLM to load a blockwise checkpoint.

    A linear is kept when :func:`transformers_block_grid_problem` or :func:`vllm_shard_alignment_problem` flags
    its weight, or when another shard of the same vLLM fused layer is kept (vLLM's ``is_layer_skipped`` raises
    ``Detected some but not all shards of ... are quantized``): q/k/v of a layer, gate/up of a dense MLP, and all
    experts of a MoE layer go together.

    Args:
      shapes: ``{hf_name: shape}`` (params or :func:`fp8rl_jax.models.config.hf_param_shapes`); only names
        :func:`is_quantized_linear` accepts are considered.
      block_size: FP8 weight block edge.

    Returns:
      ``{module_name: reason}`` in name order, ``module_name`` without ``.weight`` (the names transformers'
      ``modules_to_not_convert`` and vLLM's ``ignored_layers`` match exactly); a MoE layer's experts appear once,
      as ``model.layers.{i}.mlp.experts`` (vLLM skips a ``FusedMoE`` whose prefix is contained in an ignored name,
      transformers skips the ``experts`` module whose name it matches). Reasons are layer-independent text, e.g.
      ``"transformers: dim 576 is neither a multiple of 128 nor <= 128"``, ``"vLLM: 192 rows, a qkv_proj shard
      needs a multiple of 128"``, ``"vLLM fuses it with k_proj, v_proj into qkv_proj, one precision per fused
      layer"``.
    """
    own: dict[str, list[str]] = {}
    groups: dict[str, list[str]] = {}
    for name, shape in shapes.items():
        if not is_quantized_linear(name):
            continue
        module = name[:-len(".weight")]
        groups.setdefault(_fused_group(module), []).append(module)
        why = []
        t = transformers_block_grid_problem(shape, block_size)
        if t:
            why.append(f"transformers: {t}")
        if vllm_shard_alignment_problem(name, shape, block_size):
            fused = VLLM_FUSED_SHARDS[module.rsplit(".", 1)[1]]
            why.append(f"vLLM: {int(shape[0])} rows, a {fused} shard needs a multiple of {block_size}")
        if why:
            own[module] = why
    out: dict[str, str] = {}
    for group, members in groups.items():
        bad = [m for m in members if m in own]
        if not bad:
            continue
        if group.endswith(".mlp.experts"):
            reasons = sorted({r for m in bad for r in own[m]})
            out[group] = "; ".join(reasons) + " (experts of a layer are one vLLM FusedMoE)"
            continue
        fused = group.rsplit(".", 1)[1]
        culprits = sorted({m.rsplit(".", 1)[1] for m in bad})
        for m in members:
            out[m] = ("; ".join(own[m]) if m in own
                      else f"vLLM fuses it with {', '.join(culprits)} into {fused}, one precision per fused layer")
    return dict(sorted(out.items()))
