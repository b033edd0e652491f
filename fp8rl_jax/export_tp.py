"""Per-step export straight into vLLM's tensor-parallel layout: every device quantizes and keeps its own shard.

:func:`export_weights` (``fp8rl_jax.export``) returns whole tensors, which a sharded trainer would have to gather
before a vLLM worker of tensor-parallel size ``tp`` narrows them again. :func:`export_tp_shards` instead builds,
in one jitted program on the trainer's mesh, the *local* parameters of each vLLM TP rank, under vLLM's own
parameter names and layouts, and quantizes them where they live:

==========================  ===========================================  =======================================
vLLM parameter (rank r)     layout                                       vLLM layer
==========================  ===========================================  =======================================
``self_attn.qkv_proj``      rows ``[q_r; k_r; v_r]``, ``[(Hq+2Hkv)/tp*D, H]`` ``QKVParallelLinear`` (kv heads
                                                                         replicated when ``Hkv < tp``)
``self_attn.o_proj``        columns ``r`` of ``tp``: ``[H, Hq*D/tp]``     ``RowParallelLinear``
``mlp.gate_up_proj``        rows ``[gate_r; up_r]``, ``[2I/tp, H]``       ``MergedColumnParallelLinear``
``mlp.down_proj``           ``[H, I/tp]``                                 ``RowParallelLinear``
``mlp.experts.w13_weight``  ``[E, 2I/tp, H]`` (w1 = gate, then w3 = up)   ``FusedMoE`` (TP, no EP)
``mlp.experts.w2_weight``   ``[E, H, I/tp]``                              ``FusedMoE``
``embed_tokens``/``lm_head`` rows ``r`` of the vocab padded to 64: ``[V'/tp, H]``, ``VocabParallelEmbedding`` /
                            rows past the vocab zero                     ``ParallelLMHead``
norms, router ``mlp.gate``  whole, on every rank                         replicated
==========================  ===========================================  =======================================

FP8 (``fmt="fp8_blockwise"``): every linear above becomes e4m3 ``weight`` plus float32 ``weight_scale_inv`` of
128x128 blocks (``w13_weight_scale_inv`` / ``w2_weight_scale_inv`` for experts), quantized per rank from the rank's
own rows/columns. A rank's part of every quantized dimension must be a multiple of ``block_size`` (vLLM's
blockwise loader asks the same), so the blocks are the blocks of the whole tensor and the shards equal the
corresponding slices of :func:`fp8rl_jax.export.export_weights` bit for bit (tested).

Placement: each output is a global array ``[tp, *local]`` sharded on its first dimension over the mesh axes
``tp_axes`` (in mesh order: rank ``r`` = the device whose index along those axes, row-major, is ``r``) and
replicated over the other mesh axes. Going from the trainer's sharding (``fp8rl_jax.parallel.rules``) to this
one is a reshard XLA plans (an all-gather only within the groups that share a rank's rows, e.g. over ``fsdp``),
never a gather of a whole tensor to one device; the quantization then runs under ``shard_map``, local to each
device. :meth:`TPShardedExport.rank_tensors` hands out the ``[1, *local]`` shard of one rank (no copy; a torch
consumer squeezes the leading 1 with a view).

Sources: vLLM ``QKVParallelLinear`` / ``MergedColumnParallelLinear`` / ``RowParallelLinear`` weight loaders
(``vllm/model_executor/layers/linear.py``), ``VocabParallelEmbedding.weight_loader`` and ``pad_vocab_size``
(``vocab_parallel_embedding.py``, padding 64), ``FusedMoE._load_w13`` / ``_load_w2``; the scale layout of
vLLM's ``Fp8LinearMethod`` block quantization (DeepSeek-V3 / Qwen3-FP8 checkpoints).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from fp8rl_jax.export import _nan_code_present, _nonfinite_present
from fp8rl_jax.fp8 import BLOCK_SIZE, quantize_weight_blockwise
from fp8rl_jax.models.config import ModelConfig

VOCAB_PADDING = 64  # vLLM DEFAULT_VOCAB_PADDING_SIZE
TP_FORMATS = ("fp8_blockwise", "bf16", "float32")

_LAYER = re.compile(r"^(model\.layers\.(\d+)\.)(.+)$")


@dataclasses.dataclass(frozen=True)
class _Out:
    """One vLLM parameter: how its rank-stacked ``[tp, *local]`` array is built from HF tensors."""

    kind: str  # column | kv | row | vocab | replicated | w13 | w2 | w13s | w2s
    parts: tuple  # HF names (qkv/gate_up: several; w13/w2: per expert (gate, up) / down; w13s/w2s: the stacks)
    quantize: bool


def _plan(names: set[str], cfg: ModelConfig, fuse: bool) -> dict[str, _Out]:
    """``{vllm_name: _Out}`` for the HF ``names``; raises ValueError on a name it cannot place."""
    out: dict[str, _Out] = {}
    experts: dict[str, dict[int, dict[str, str]]] = {}
    stacked: dict[str, dict[str, str]] = {}
    for name in sorted(names):
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            out[name] = _Out("vocab", (name,), False)
            continue
        m = _LAYER.match(name)
        rest = m.group(3) if m else ""
        if not m or rest.endswith("norm.weight") or rest == "mlp.gate.weight":
            if not (name.endswith("norm.weight") or rest == "mlp.gate.weight"):
                raise ValueError(f"no tensor-parallel layout for {name}")
            out[name] = _Out("replicated", (name,), False)
            continue
        prefix = m.group(1)
        st = re.match(r"mlp\.experts\.(gate|up|down)_proj\.weight$", rest)
        if st:  # the model's stacked experts [E, N, K] (ModelParamsReader): w13 / w2 straight from the stacks
            stacked.setdefault(prefix, {})[st.group(1)] = name
            continue
        e = re.match(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$", rest)
        if e:
            experts.setdefault(prefix, {}).setdefault(int(e.group(1)), {})[e.group(2)] = name
            continue
        a = re.match(r"self_attn\.(q|k|v|o)_proj\.(weight|bias)$", rest)
        d = re.match(r"mlp\.(gate|up|down)_proj\.weight$", rest)
        if a and a.group(1) == "o":
            if a.group(2) == "bias":  # RowParallelLinear adds its bias once, after the all-reduce: whole on every rank
                out[name] = _Out("replicated", (name,), False)
            else:
                out[name] = _Out("row", (name,), True)
        elif a:
            kind = "column" if a.group(1) == "q" else "kv"
            if fuse:
                fused = f"{prefix}self_attn.qkv_proj.{a.group(2)}"
                parts = tuple(f"{prefix}self_attn.{p}_proj.{a.group(2)}" for p in "qkv")
                missing = [p for p in parts if p not in names]
                if missing:
                    raise ValueError(f"cannot fuse {fused}: missing {missing}")
                out[fused] = _Out("qkv", parts, a.group(2) == "weight")
            else:
                out[name] = _Out(kind, (name,), a.group(2) == "weight")
        elif d and d.group(1) == "down":
            out[name] = _Out("row", (name,), True)
        elif d:
            if fuse:
                parts = (f"{prefix}mlp.gate_proj.weight", f"{prefix}mlp.up_proj.weight")
                missing = [p for p in parts if p not in names]
                if missing:
                    raise ValueError(f"cannot fuse {prefix}mlp.gate_up_proj.weight: missing {missing}")
                out[f"{prefix}mlp.gate_up_proj.weight"] = _Out("gate_up", parts, True)
            else:
                out[name] = _Out("column", (name,), True)
        else:
            raise ValueError(f"no tensor-parallel layout for {name}")
    for prefix, by_proj in stacked.items():
        if prefix in experts:
            raise ValueError(f"{prefix}mlp.experts: both stacked and per-expert tensors given")
        if set(by_proj) != {"gate", "up", "down"}:
            raise ValueError(f"{prefix}mlp.experts: expected stacked gate/up/down_proj, got {sorted(by_proj)}")
        out[f"{prefix}mlp.experts.w13_weight"] = _Out("w13s", (by_proj["gate"], by_proj["up"]), True)
        out[f"{prefix}mlp.experts.w2_weight"] = _Out("w2s", (by_proj["down"],), True)
    for prefix, by_expert in experts.items():
        ids = sorted(by_expert)
        if ids != list(range(len(ids))) or any(set(v) != {"gate", "up", "down"} for v in by_expert.values()):
            raise ValueError(f"{prefix}mlp.experts: expected gate/up/down_proj for experts 0..{len(ids) - 1}")
        out[f"{prefix}mlp.experts.w13_weight"] = _Out(
            "w13", tuple((by_expert[j]["gate"], by_expert[j]["up"]) for j in ids), True)
        out[f"{prefix}mlp.experts.w2_weight"] = _Out("w2", tuple(by_expert[j]["down"] for j in ids), True)
    return out


def _column(x: jax.Array, tp: int, name: str) -> jax.Array:
    if x.shape[0] % tp:
        raise ValueError(f"{name}: output dimension {x.shape[0]} is not divisible by tensor-parallel size {tp}")
    return x.reshape(tp, x.shape[0] // tp, *x.shape[1:])


def _kv(x: jax.Array, tp: int, num_kv_heads: int, name: str) -> jax.Array:
    """vLLM QKVParallelLinear k/v: heads split over ranks, or replicated (rank r gets head ``r // (tp/Hkv)``)."""
    if num_kv_heads >= tp:
        if num_kv_heads % tp:
            raise ValueError(f"{name}: {num_kv_heads} kv heads are not divisible by tensor-parallel size {tp}")
        return _column(x, tp, name)
    if tp % num_kv_heads:
        raise ValueError(f"{name}: tensor-parallel size {tp} is not a multiple of the {num_kv_heads} kv heads")
    rep = tp // num_kv_heads  # rank r = head * rep + j holds head r // rep: a broadcast, not a gather
    heads = x.reshape(num_kv_heads, 1, x.shape[0] // num_kv_heads, *x.shape[1:])
    heads = jnp.broadcast_to(heads, (num_kv_heads, rep, *heads.shape[2:]))
    return heads.reshape(tp, *heads.shape[2:])


def _column_stacked(x: jax.Array, tp: int, name: str) -> jax.Array:
    """``[E, N, K]`` expert stack -> ``[tp, E, N/tp, K]`` (each expert's :func:`_column`, ranks first)."""
    if x.ndim != 3:
        raise ValueError(f"{name}: a stacked expert tensor must be [E, N, K], got shape {tuple(x.shape)}")
    if x.shape[1] % tp:
        raise ValueError(f"{name}: output dimension {x.shape[1]} is not divisible by tensor-parallel size {tp}")
    return jnp.moveaxis(x.reshape(x.shape[0], tp, x.shape[1] // tp, x.shape[2]), 1, 0)


def _row(x: jax.Array, tp: int, name: str) -> jax.Array:
    if x.shape[1] % tp:
        raise ValueError(f"{name}: input dimension {x.shape[1]} is not divisible by tensor-parallel size {tp}")
    return jnp.moveaxis(x.reshape(x.shape[0], tp, x.shape[1] // tp), 1, 0)


def _vocab(x: jax.Array, tp: int) -> jax.Array:
    padded = -(-x.shape[0] // VOCAB_PADDING) * VOCAB_PADDING
    if padded % tp:
        raise ValueError(f"vocab padded to {padded} is not divisible by tensor-parallel size {tp}")
    per = padded // tp
    x = jnp.pad(x, ((0, padded - x.shape[0]), (0, 0)))
    return x.reshape(tp, per, x.shape[1])


def _stack(o: _Out, params: dict, tp: int, num_kv_heads: int) -> jax.Array:
    """The rank-stacked ``[tp, *local]`` array of one output, in the export's dense dtype-independent form."""
    if o.kind == "column":
        return _column(params[o.parts[0]], tp, o.parts[0])
    if o.kind == "kv":
        return _kv(params[o.parts[0]], tp, num_kv_heads, o.parts[0])
    if o.kind == "row":
        return _row(params[o.parts[0]], tp, o.parts[0])
    if o.kind == "vocab":
        return _vocab(params[o.parts[0]], tp)
    if o.kind == "replicated":
        x = params[o.parts[0]]
        return jnp.broadcast_to(x[None], (tp, *x.shape))
    if o.kind == "qkv":
        q, k, v = (params[p] for p in o.parts)
        return jnp.concatenate([_column(q, tp, o.parts[0]), _kv(k, tp, num_kv_heads, o.parts[1]),
                                _kv(v, tp, num_kv_heads, o.parts[2])], axis=1)
    if o.kind == "gate_up":
        return jnp.concatenate([_column(params[p], tp, p) for p in o.parts], axis=1)
    if o.kind == "w13":
        return jnp.stack([jnp.concatenate([_column(params[g], tp, g), _column(params[u], tp, u)], axis=1)
                          for g, u in o.parts], axis=1)
    if o.kind == "w2":
        return jnp.stack([_row(params[p], tp, p) for p in o.parts], axis=1)
    if o.kind == "w13s":  # the same [tp, E, 2I/tp, H] from the [E, I, H] stacks: pure data movement
        return jnp.concatenate([_column_stacked(params[p], tp, p) for p in o.parts], axis=2)
    if o.kind == "w2s":  # [E, H, I] -> [tp, E, H, I/tp]
        x = params[o.parts[0]]
        if x.shape[2] % tp:
            raise ValueError(f"{o.parts[0]}: input dimension {x.shape[2]} is not divisible by tensor-parallel "
                             f"size {tp}")
        return jnp.moveaxis(x.reshape(x.shape[0], x.shape[1], tp, x.shape[2] // tp), 2, 0)
    raise AssertionError(o.kind)


@functools.partial(jax.jit, static_argnames=("plan", "tp", "num_kv_heads", "fmt", "block_size", "ue8m0", "mesh",
                                             "tp_axes"))
def _export_tp(params: dict, plan: tuple, tp: int, num_kv_heads: int, fmt: str, block_size: int, ue8m0: bool,
               mesh: Mesh, tp_axes: tuple):
    spec = NamedSharding(mesh, PartitionSpec(tp_axes))
    dense = jnp.float32 if fmt == "float32" else jnp.bfloat16
    out, bad = {}, []
    for name, o in plan:
        x = jax.lax.with_sharding_constraint(_stack(o, params, tp, num_kv_heads), spec)
        if fmt == "fp8_blockwise" and o.quantize:
            def local(w):  # this device's [1, ..., N, K] rows: quantized where they live
                q, s = quantize_weight_blockwise(w, block_size, ue8m0, check=False)
                return q, s, _nan_code_present(q)[None]  # exact NaN/inf test (see fp8rl_jax.export)

            q, s, b = jax.shard_map(local, mesh=mesh, in_specs=PartitionSpec(tp_axes),
                                    out_specs=(PartitionSpec(tp_axes), PartitionSpec(tp_axes),
                                               PartitionSpec(tp_axes)))(x)
            out[name], out[_scale_name(name)] = q, s
            bad.append(jnp.any(b))
        else:
            out[name] = x.astype(dense)
            bad.append(_nonfinite_present(x))
    return out, jnp.stack(bad)


def _scale_name(name: str) -> str:
    return name[: -len(".weight")] + ".weight_scale_inv" if name.endswith(".weight") else name + "_scale_inv"


@dataclasses.dataclass
class TPShardedExport:
    """One step's weights in vLLM's tensor-parallel layout, each rank's part on its own device(s).

    Attributes:
      tensors: ``{vllm_name: jax.Array [tp, *local]}`` sharded on dim 0 over ``tp_axes`` (e4m3 weights, float32
        ``*_scale_inv``, bf16/float32 dense tensors).
      tp: tensor-parallel size. tp_axes: the mesh axes of the TP group. mesh: the mesh.
      format, block_size, version: as :class:`fp8rl_jax.rollout.types.ExportedWeights`.
    """

    tensors: dict[str, jax.Array]
    tp: int
    tp_axes: tuple[str, ...]
    mesh: Mesh
    format: str
    block_size: int
    version: int

    def rank_devices(self, rank: int) -> list[jax.Device]:
        """The devices holding rank ``rank``'s shard (several when the mesh has axes outside ``tp_axes``).

        Raises:
          ValueError: ``rank`` not in ``[0, tp)``.
        """
        if not 0 <= rank < self.tp:
            raise ValueError(f"rank {rank} is not in [0, {self.tp})")
        first = next(iter(self.tensors.values()))
        return [d for d, idx in first.sharding.devices_indices_map(first.shape).items()
                if (idx[0].start or 0) == rank]

    def rank_tensors(self, rank: int, device: jax.Device | None = None) -> dict[str, jax.Array]:
        """``{vllm_name: [1, *local]}``: rank ``rank``'s shards as they sit on ``device`` (default: the first
        addressable device holding that rank); no copy (the arrays are the export's own shard buffers).

        Raises:
          ValueError: ``rank`` out of range, or no device of this process holds it (multi-process meshes: ask the
            process that owns it).
        """
        devs = [d for d in self.rank_devices(rank) if d.process_index == jax.process_index()]
        if device is None:
            if not devs:
                raise ValueError(f"rank {rank}'s shard is on no device of process {jax.process_index()}")
            device = devs[0]
        elif device not in devs:
            raise ValueError(f"device {device} does not hold rank {rank}'s shard (holders: {devs})")
        out = {}
        for name, arr in self.tensors.items():
            (shard,) = [s for s in arr.addressable_shards if s.device == device]
            out[name] = shard.data
        return out

    @property
    def nbytes_per_rank(self) -> int:
        """Bytes of one rank's shards (what one vLLM worker receives)."""
        return int(sum(a.nbytes // self.tp for a in self.tensors.values()))


def export_tp_shards(params: dict[str, jax.Array], cfg: ModelConfig, mesh: Mesh, *, tp_axes=("tensor",),
                     fmt: str = "fp8_blockwise", block_size: int = BLOCK_SIZE, ue8m0: bool = False,
                     fuse: bool = True, version: int = 0, check_finite: bool = True) -> TPShardedExport:
    """Export HF-named params (sharded or not) as vLLM TP-rank-local tensors, quantized per device.

    Args:
      params: ``{hf_name: array}`` (the trainer's params, e.g. ``named_params(model)``, any sharding on
        ``mesh``); linears ``[out, in]``. Qwen3-MoE experts per expert (HF names) or as the model's stacks
        (``...mlp.experts.{gate,up,down}_proj.weight`` ``[E, N, K]``,
        :class:`fp8rl_jax.export.ModelParamsReader`): ``w13`` / ``w2`` are then built straight from the stacks
        (the same bytes).
      cfg: the model config (kv heads, for k/v replication when ``Hkv < tp``).
      mesh: the trainer's mesh.
      tp_axes: mesh axes forming vLLM's tensor-parallel group (``tp`` = product of their sizes), e.g.
        ``("tensor",)`` or ``("fsdp", "tensor")`` for TP over all 8 devices of an fsdp=2 x tensor=4 mesh.
      fmt: ``"fp8_blockwise"`` | ``"bf16"`` | ``"float32"``.
      block_size: FP8 block edge (128). ue8m0: power-of-two scales.
      fuse: vLLM's fused ``qkv_proj`` / ``gate_up_proj`` (what a vLLM worker's parameters are); ``False``: one
        output per HF projection, still rank-local (for a consumer that keeps q/k/v apart).
      version: the weights version recorded.
      check_finite: refuse NaN/inf weights (judged from each rank's scales / dense values in the same program;
        one host read of a bool per output).

    Returns:
      :class:`TPShardedExport`.

    Raises:
      ValueError: unknown ``fmt`` or mesh axis; a dimension not divisible by ``tp``; a rank's part of a quantized
        dimension not a multiple of ``block_size`` (names the tensor); a name with no TP layout; non-finite
        weights (names up to five outputs).
    """
    args, plan = _program_args(params, cfg, mesh, tuple(tp_axes), fmt, block_size, ue8m0, fuse)
    tensors, bad = _export_tp(*args)
    if check_finite:
        flags = np.asarray(jax.device_get(bad))
        if flags.any():
            names = [n for n, _ in plan]
            raise ValueError(f"refusing to export non-finite weights: {[names[i] for i in np.flatnonzero(flags)[:5]]} "
                             "contain NaN or inf")
    return TPShardedExport(tensors=tensors, tp=args[2], tp_axes=tuple(tp_axes), mesh=mesh, format=fmt,
                           block_size=int(block_size), version=int(version))


def lower_export_tp(params: dict[str, jax.Array], cfg: ModelConfig, mesh: Mesh, *, tp_axes=("tensor",),
                    fmt: str = "fp8_blockwise", block_size: int = BLOCK_SIZE, ue8m0: bool = False,
                    fuse: bool = True) -> jax.stages.Lowered:
    """The program :func:`export_tp_shards` runs, lowered for ``params``' shardings (not run): for inspecting its
    collectives (``.compile().as_text()``) and per-device memory (``.compile().memory_analysis()``).

    Arguments and errors as :func:`export_tp_shards`.
    """
    args, _ = _program_args(params, cfg, mesh, tuple(tp_axes), fmt, block_size, ue8m0, fuse)
    return _export_tp.lower(*args)


def _program_args(params, cfg, mesh, tp_axes, fmt, block_size, ue8m0, fuse):
    """``(arguments of _export_tp, sorted plan items)``, after validating formats, mesh axes and block sizes."""
    if fmt not in TP_FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; expected one of {TP_FORMATS}")
    unknown = [a for a in tp_axes if a not in mesh.shape]
    if unknown:
        raise ValueError(f"tp_axes {unknown} are not axes of the mesh {dict(mesh.shape)}")
    tp = math.prod(int(mesh.shape[a]) for a in tp_axes)
    plan = _plan(set(params), cfg, fuse)
    for name, o in plan.items():
        if fmt != "fp8_blockwise" or not o.quantize:
            continue
        shape = jax.eval_shape(lambda p, o=o: _stack(o, p, tp, cfg.num_key_value_heads),
                               {k: params[k] for k in _flat_parts(o)}).shape
        n, k = shape[-2], shape[-1]
        if n % block_size or k % block_size:
            raise ValueError(f"{name}: each of the {tp} ranks holds [{n}, {k}], not a multiple of the "
                             f"{block_size}x{block_size} FP8 blocks (vLLM's blockwise loader needs rank-local "
                             "sizes divisible by the block size)")
    items = tuple(sorted(plan.items()))
    return (dict(params), items, tp, int(cfg.num_key_value_heads), fmt, int(block_size), bool(ue8m0), mesh,
            tp_axes), items


def _flat_parts(o: _Out) -> list[str]:
    out = []
    for p in o.parts:
        out.extend(p if isinstance(p, tuple) else (p,))
    return out
