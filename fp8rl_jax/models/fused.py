"""Fused projections of the FP8 rollout model: vLLM's ``qkv_proj`` and ``gate_up_proj`` (issue 21).

A decode step runs q, k and v on the same input, and a dense MLP's gate and up on the same input. vLLM serves
each set as one layer whose weight is the row concatenation of the checkpoint shards
(``QKVParallelLinear``: ``self_attn.qkv_proj`` rows ``[q; k; v]``; ``MergedColumnParallelLinear``:
``mlp.gate_up_proj`` rows ``[gate; up]``; ``vllm/model_executor/layers/linear.py``), so the activation is
quantized once and one FP8 GEMM runs instead of three (two). The embedded engine does the same with the names and
row order of vLLM at tensor-parallel size 1:

==============================  ==========================================  ======================================
fused module                    ``weight`` (e4m3) / ``weight_scale_inv``    parts (HF checkpoint modules)
==============================  ==========================================  ======================================
``model.layers.{i}.self_attn``  ``[Nq + 2 Nkv, K]`` / ``[(Nq + 2 Nkv)/128,   ``self_attn.q_proj``, ``k_proj``,
``.qkv_proj``                   K/128]`` (+ ``bias [Nq + 2 Nkv]``, Qwen2)   ``v_proj``
``model.layers.{i}.mlp``        ``[2 I, K]`` / ``[2 I / 128, K/128]``        ``mlp.gate_proj``, ``mlp.up_proj``
``.gate_up_proj``
==============================  ==========================================  ======================================

Blocks must not straddle parts: a group is fused only when every part's output rows are a multiple of the FP8
block size (128), so the fused ``weight_scale_inv`` is exactly the row concatenation of the parts' scales and
each output column's W8A8 product (its K reduction, its weight block scale) is the part's own. This is also vLLM's
rule for blockwise FP8 shards (:func:`fp8rl_jax.export.vllm_shard_alignment_problem`). Otherwise the group stays
unfused (e.g. SmolLM2-135M: q 576 and k/v 192 rows, so only its gate|up, 1536 rows each, fuse). Qwen3-MoE
experts are not fused here (their grouped kernel already runs gate|up as one ``w13``:
:mod:`fp8rl_jax.models.moe`); a Qwen3-MoE layer's attention is.

The trainer's model and the checkpoints keep the separate HF names; :func:`fuse_tensors` and
:func:`split_tensors` convert between the two namings.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Mapping, Sequence

import jax

from fp8rl_jax.fp8.formats import BLOCK_SIZE
from fp8rl_jax.kernels.pallas_quant import concat_rows

#: fused module (relative to a decoder layer) -> its parts, in vLLM's row order
FUSED_PROJECTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
)
#: tensors of a fused module, each the row concatenation of the parts' tensors of the same suffix
FUSED_SUFFIXES = ("weight", "weight_scale_inv", "bias")

_LAYER = re.compile(r"^(model\.layers\.\d+\.)")


@dataclasses.dataclass(frozen=True)
class FusedProjection:
    """One fused linear: ``name`` holds the row concatenation of ``parts`` (hashable: a jit static argument).

    Attributes:
      name: fused module, e.g. ``"model.layers.3.self_attn.qkv_proj"``.
      parts: the HF modules it concatenates, in row order (``"model.layers.3.self_attn.q_proj"``, ...).
      rows: output features of each part (``N_i``; multiples of ``block_size``).
      block_size: FP8 weight block edge the alignment was checked for.
    """

    name: str
    parts: tuple[str, ...]
    rows: tuple[int, ...]
    block_size: int = BLOCK_SIZE

    @property
    def offsets(self) -> tuple[int, ...]:
        """First output row of each part in the fused weight (``(0, N_0, N_0 + N_1, ...)``, one per part)."""
        out, r = [], 0
        for n in self.rows:
            out.append(r)
            r += n
        return tuple(out)

    @property
    def total_rows(self) -> int:
        """``sum(rows)``: the fused weight's output features."""
        return sum(self.rows)


def fusion_problem(shapes: Sequence[Sequence[int] | None], block_size: int = BLOCK_SIZE) -> str | None:
    """Why weights of these shapes cannot share one blockwise FP8 weight, or None when they can.

    Args:
      shapes: each part's weight shape ``[N_i, K]`` (HF ``[out, in]``), in row order; None for a missing part.
      block_size: FP8 weight block edge (128).

    Returns:
      e.g. ``"part 1 has 192 output rows, not a multiple of 128"`` (a 128-row scale block would straddle two
      parts), ``"parts have different input sizes [576, 512]"``, ``"part 2 is missing"``, or None.
    """
    for i, s in enumerate(shapes):
        if s is None:
            return f"part {i} is missing"
        if len(s) != 2:
            return f"part {i} has shape {tuple(s)}, not [out, in]"
    ks = [int(s[1]) for s in shapes]
    if len(set(ks)) != 1:
        return f"parts have different input sizes {ks}"
    for i, s in enumerate(shapes):
        if int(s[0]) % block_size:
            return f"part {i} has {int(s[0])} output rows, not a multiple of {block_size}"
    return None


def _groups(shapes: Mapping[str, Sequence[int]], block_size: int, exclude: Sequence[str]):
    """``[(fused module, part modules, part shapes or None, problem or None)]`` for every decoder layer of ``shapes``."""
    layers = sorted({m.group(1) for n in shapes if (m := _LAYER.match(n))}, key=lambda p: int(p.split(".")[2]))
    out = []
    for prefix in layers:
        for fused, parts in FUSED_PROJECTIONS:
            mods = tuple(prefix + p for p in parts)
            got = [shapes.get(m + ".weight") for m in mods]
            if all(g is None for g in got):
                continue  # this layer has no such projections (a Qwen3-MoE sparse layer has no mlp.gate_proj)
            problem = fusion_problem(got, block_size)
            if problem is None and any(_in_modules(m, exclude) for m in mods):
                problem = "a part is excluded (kept unquantized)"
            out.append((prefix + fused, mods, got, problem))
    return out


def _in_modules(module: str, prefixes: Sequence[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def fused_projections(shapes: Mapping[str, Sequence[int]], block_size: int = BLOCK_SIZE, *,
                      exclude: Sequence[str] = ()) -> tuple[FusedProjection, ...]:
    """The q/k/v and gate/up groups of HF-named ``shapes`` that fuse (see the module docstring for the rule).

    Args:
      shapes: ``{hf_name: shape}``, e.g. :func:`fp8rl_jax.models.config.hf_param_shapes` or a params dict's
        shapes; only ``model.layers.{i}.{self_attn.{q,k,v}_proj, mlp.{gate,up}_proj}.weight`` are read (never
        ``mlp.experts.{j}.*``).
      block_size: FP8 weight block edge.
      exclude: module names (or prefixes, as :func:`fp8rl_jax.export.export_weights`'s ``unquantized``) whose
        group must stay unfused.

    Returns:
      one :class:`FusedProjection` per fused group, in layer order then ``qkv``, ``gate_up``.
    """
    return tuple(FusedProjection(name, mods, tuple(int(s[0]) for s in got), int(block_size))
                 for name, mods, got, problem in _groups(shapes, block_size, exclude) if problem is None)


def unfused_projections(shapes: Mapping[str, Sequence[int]], block_size: int = BLOCK_SIZE, *,
                        exclude: Sequence[str] = ()) -> dict[str, str]:
    """``{fused module name: reason}`` for the groups of ``shapes`` that stay unfused (arguments as
    :func:`fused_projections`), e.g. ``{"model.layers.0.self_attn.qkv_proj": "part 1 has 192 output rows, not a
    multiple of 128"}`` for SmolLM2-135M."""
    return {name: problem for name, _, _, problem in _groups(shapes, block_size, exclude) if problem is not None}


def fuse_tensors(tensors: Mapping[str, jax.Array], groups: Sequence[FusedProjection]) -> dict[str, jax.Array]:
    """Replace each group's part tensors by their row concatenation under the fused name (vLLM's layout).

    For every group and every suffix of :data:`FUSED_SUFFIXES` held by the parts (``weight``; FP8:
    ``weight_scale_inv``; Qwen2: ``bias``) the result has ``{group.name}.{suffix}`` = concatenation of
    ``{part}.{suffix}`` along dim 0 (``weight [sum N_i, K]``, ``weight_scale_inv [sum N_i / 128, ceil(K/128)]``,
    ``bias [sum N_i]``), and no part names; every other tensor passes through unchanged (the same array). A group
    already present under its fused name is passed through. Traceable (runs inside ``jax.jit``); eagerly each
    concatenation is a copy.

    Args:
      tensors: ``{hf_name: array}``.
      groups: from :func:`fused_projections`.

    Returns:
      ``{name: array}`` in the fused naming.

    Raises:
      KeyError: a group's parts are only partly present (names the missing tensors).
      ValueError: a part's tensor does not have the group's rows (``N_i``, or ``N_i / block_size`` scale rows) or
        the first part's trailing dimensions.
    """
    out = dict(tensors)
    for g in groups:
        for suffix in FUSED_SUFFIXES:
            names = [f"{p}.{suffix}" for p in g.parts]
            have = [n in out for n in names]
            if not any(have) or f"{g.name}.{suffix}" in out:
                continue
            if not all(have):
                raise KeyError(f"cannot fuse {g.name}.{suffix}: missing {[n for n, h in zip(names, have) if not h]}")
            parts = [out.pop(n) for n in names]
            for n, a, rows in zip(names, parts, g.rows):
                want = rows // g.block_size if suffix == "weight_scale_inv" else rows
                if a.shape[0] != want or tuple(a.shape[1:]) != tuple(parts[0].shape[1:]):
                    raise ValueError(f"{n} has shape {tuple(a.shape)}, {g.name}.{suffix} expects {want} rows and "
                                     f"the trailing dims {tuple(parts[0].shape[1:])} of {names[0]}")
            out[f"{g.name}.{suffix}"] = concat_rows(parts)
    return out


def fused_names(names, groups: Sequence[FusedProjection]) -> list[str]:
    """The names :func:`fuse_tensors` would return for tensors named ``names`` (sorted; no arrays needed)."""
    out = set(names)
    for g in groups:
        for suffix in FUSED_SUFFIXES:
            parts = {f"{p}.{suffix}" for p in g.parts}
            if parts & out:
                out = (out - parts) | {f"{g.name}.{suffix}"}
    return sorted(out)


def split_names(names, groups: Sequence[FusedProjection]) -> list[str]:
    """The names :func:`split_tensors` would return for tensors named ``names`` (sorted; no arrays needed)."""
    out = set(names)
    for g in groups:
        for suffix in FUSED_SUFFIXES:
            if f"{g.name}.{suffix}" in out:
                out = (out - {f"{g.name}.{suffix}"}) | {f"{p}.{suffix}" for p in g.parts}
    return sorted(out)


def split_tensors(tensors: Mapping[str, jax.Array], groups: Sequence[FusedProjection]) -> dict[str, jax.Array]:
    """The inverse of :func:`fuse_tensors`: each fused tensor as its parts' row slices under the HF names.

    Args:
      tensors: ``{name: array}`` in the fused naming (other names pass through unchanged).
      groups: the fused groups (:func:`fused_projections`).

    Returns:
      ``{hf_name: array}``; the parts are slices (copies when run eagerly).
    """
    out = dict(tensors)
    for g in groups:
        for suffix in FUSED_SUFFIXES:
            name = f"{g.name}.{suffix}"
            if name not in out:
                continue
            a = out.pop(name)
            div = g.block_size if suffix == "weight_scale_inv" else 1
            for p, r0, n in zip(g.parts, g.offsets, g.rows):
                out[f"{p}.{suffix}"] = a[r0 // div:(r0 + n) // div]
    return out


def layer_fusion(groups: Sequence[FusedProjection], layer: int) -> tuple[bool, bool]:
    """``(fuse_qkv, fuse_gate_up)`` of decoder layer ``layer`` under ``groups``."""
    names = {g.name for g in groups}
    p = f"model.layers.{layer}."
    return p + "self_attn.qkv_proj" in names, p + "mlp.gate_up_proj" in names
