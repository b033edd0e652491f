"""The sharding rules, all in one place: HF parameter name -> logical axes -> mesh axes -> ``NamedSharding``.

Two tables, in the maxtext / tunix style (maxtext ``logical_axis_rules`` in ``base.yml``; tunix
``models/*/model.py`` ``ShardingConfig``):

1. :data:`PARAM_RULES`: a regular expression on the HF parameter name (``model.layers.3.self_attn.q_proj.weight``,
   the NNX state path of :mod:`fp8rl_jax.models`) gives the *logical* axes of each dimension, e.g. ``q_proj.weight``
   ``[heads*head_dim, hidden]`` is ``("q_heads", "embed")``. Layouts are HF's ``[out, in]``. A stacked leading
   dimension (a path with ``layers`` or ``experts`` not followed by an index, as a layer ``nnx.scan`` or a stacked
   expert layout would produce) gets the logical axis ``layers`` / ``experts`` in front.
2. :data:`LOGICAL_RULES`: each logical axis -> the mesh axes (of :data:`fp8rl_jax.parallel.mesh.MESH_AXES`) it is
   sharded over, e.g. ``embed -> (fsdp, expert)``, ``q_heads -> (tensor,)``, ``batch -> (data, fsdp, expert)``.

Divisibility: a dimension whose size is not divisible by the product of its mesh axes drops mesh axes from the end
of its list until it is (down to none: replicated). No error is raised, because replication is always correct
and only costs memory; :func:`sharding_plan` reports every such fallback (``ShardingPlan.fallbacks``) so a user can
see what was replicated, and the trainer logs them. A mesh axis is used at most once per array (a later dimension
that asks for an axis already taken by an earlier one does without it). Parameters no rule matches are
replicated and listed in ``ShardingPlan.unmatched``.

MoE experts: the model stacks each layer's experts (``mlp.experts.gate_proj.weight`` ``[E, I, H]``,
``down_proj`` ``[E, H, I]``, :mod:`fp8rl_jax.models.experts`), so the leading dimension gets the logical axis
``experts`` -> mesh axis ``expert`` (expert parallelism of the weights: each device of an ``expert=4`` mesh holds
``E/4`` experts), and each expert's inner dimensions are sharded like a dense MLP's (``expert_mlp -> tensor``,
``embed -> fsdp``; ``embed`` does not get ``expert`` again, a mesh axis is used once per array). The per-expert HF
names (``mlp.experts.{j}.gate_proj.weight``, what checkpoints, exports and vLLM use) match the same rules without
the leading axis. The tokens' rows reach their experts by the all-to-all dispatch of
:mod:`fp8rl_jax.models.expert_parallel` (``moe.dispatch``, the default on an ``expert > 1`` mesh): each device
computes only its ``E / expert`` experts. With ``moe.dispatch = "replicated"`` the grouped matmul is instead
partitioned by XLA's sharding propagation: exact, but the per-tile weight gather from an ``expert``-sharded stack
becomes a masked local gather plus an all-reduce and every device computes all tiles on its ``fsdp`` shard; the
axis then saves parameter and optimizer memory only.

Float8 linears (``weight`` e4m3 + ``weight_scale_inv`` ``[ceil(N/128), ceil(K/128)]``) get the weight's logical
axes on both (the scale grid is then usually replicated by the divisibility rule).

Activations carry no annotations inside the model (its code is not annotated); the train step constrains the
batch to ``batch -> (data, fsdp, expert)`` at its inputs and XLA's sharding propagation does the rest.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Mapping, Sequence

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

#: (regex on the HF name, logical axes of the unstacked array). First match wins. Sources: HF layouts of
#: ``LlamaForCausalLM`` / ``Qwen3MoeForCausalLM``; logical names follow maxtext (``embed``, ``vocab``, ``q_heads``,
#: ``kv_heads``, ``mlp``, ``exp``/``experts``, ``layers``, ``norm``).
PARAM_RULES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    (r"(^|\.)embed_tokens\.weight$", ("vocab", "embed")),
    (r"(^|\.)lm_head\.weight(_scale_inv)?$", ("vocab", "embed")),
    (r"\.mlp\.experts(\.\d+)?\.(gate_proj|up_proj)\.weight(_scale_inv)?$", ("expert_mlp", "embed")),
    (r"\.mlp\.experts(\.\d+)?\.down_proj\.weight(_scale_inv)?$", ("embed", "expert_mlp")),
    (r"\.mlp\.gate\.weight$", ("router_experts", "embed")),
    (r"\.self_attn\.q_proj\.weight(_scale_inv)?$", ("q_heads", "embed")),
    (r"\.self_attn\.q_proj\.bias$", ("q_heads",)),
    (r"\.self_attn\.(k_proj|v_proj)\.weight(_scale_inv)?$", ("kv_heads", "embed")),
    (r"\.self_attn\.(k_proj|v_proj)\.bias$", ("kv_heads",)),
    (r"\.self_attn\.o_proj\.weight(_scale_inv)?$", ("embed", "q_heads")),
    (r"\.mlp\.(gate_proj|up_proj)\.weight(_scale_inv)?$", ("mlp", "embed")),
    (r"\.mlp\.down_proj\.weight(_scale_inv)?$", ("embed", "mlp")),
    (r"\.self_attn\.(q_norm|k_norm)\.weight$", ("head_dim",)),
    (r"norm\.weight$", ("norm",)),
)

#: logical axis -> mesh axes, in order of preference (maxtext ``logical_axis_rules``: ``activation_batch`` ->
#: data/fsdp/expert, ``embed`` -> fsdp (+ expert), ``heads``/``mlp``/``vocab`` -> tensor, ``exp`` -> expert).
LOGICAL_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("batch", ("data", "fsdp", "expert")),
    ("vocab", ("tensor",)),
    ("embed", ("fsdp", "expert")),
    ("q_heads", ("tensor",)),
    ("kv_heads", ("tensor",)),
    ("mlp", ("tensor",)),
    ("expert_mlp", ("tensor",)),
    ("experts", ("expert",)),
    ("router_experts", ()),
    ("layers", ()),
    ("head_dim", ()),
    ("norm", ()),
    ("length", ()),
)


def param_logical_axes(name: str, ndim: int) -> tuple[str | None, ...] | None:
    """Logical axes of parameter ``name`` with ``ndim`` dimensions, or None when no rule matches.

    A stacked leading dimension is recognised from the path (``...layers.weight`` style, ``layers`` not followed
    by an index; likewise ``experts``) and gets ``"layers"`` / ``"experts"`` in front.

    Args:
      name: HF-style dotted name (``model.layers.0.mlp.down_proj.weight``).
      ndim: the array's rank.

    Returns:
      a tuple of length ``ndim`` (entries are logical names or None), or None (no rule, or the rank does not fit).
    """
    for pattern, axes in PARAM_RULES:
        if re.search(pattern, name):
            parts = name.split(".")
            lead: list[str] = []
            for stacked in ("layers", "experts"):
                if stacked in parts:
                    i = parts.index(stacked)
                    if i + 1 >= len(parts) or not parts[i + 1].isdigit():
                        lead.append(stacked)
            full = tuple(lead) + tuple(axes)
            return full if len(full) == ndim else None
    return None


@dataclasses.dataclass
class ShardingPlan:
    """Per-parameter result of the rules (see :func:`sharding_plan`).

    Attributes:
      specs: ``{name: PartitionSpec}``.
      logical: ``{name: logical axes or None}``.
      fallbacks: ``[(name, dim, wanted mesh axes, used mesh axes, size)]`` where divisibility dropped axes.
      unmatched: names no rule matched (replicated).
    """

    specs: dict[str, PartitionSpec]
    logical: dict[str, tuple | None]
    fallbacks: list[tuple[str, int, tuple, tuple, int]]
    unmatched: list[str]

    def summary(self) -> str:
        """One line per fallback / unmatched parameter (empty string when there are none)."""
        lines = [f"{n}: dim {d} (size {s}) wants mesh axes {w}, uses {u or 'none (replicated)'}"
                 for n, d, w, u, s in self.fallbacks]
        lines += [f"{n}: no sharding rule, replicated" for n in self.unmatched]
        return "\n".join(lines)


def logical_to_spec(logical: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                    rules: Sequence[tuple[str, tuple[str, ...]]] = LOGICAL_RULES,
                    fallbacks: list | None = None, name: str = "") -> PartitionSpec:
    """``PartitionSpec`` for an array with ``logical`` axes and ``shape`` on ``mesh``.

    Mesh axes of size 1 are left out; an axis already used by an earlier dimension is skipped; while the
    dimension is not divisible by the product of its remaining mesh axes, the last one is dropped (down to
    replication). Each drop is appended to ``fallbacks`` (when given) as ``(name, dim, wanted, used, size)``.

    Args:
      logical: logical axis names (None = replicated dimension); same length as ``shape``.
      shape: the array shape.
      mesh: the mesh (its axis sizes decide divisibility).
      rules: logical -> mesh axes table (default :data:`LOGICAL_RULES`).
      fallbacks: optional list collecting divisibility fallbacks.
      name: array name used in the fallback records.

    Returns:
      a ``PartitionSpec`` (trailing replicated dimensions left out, the canonical form JAX gives jit outputs).

    Raises:
      ValueError: ``logical`` and ``shape`` differ in length, or a logical name has no rule (names it).
    """
    if len(logical) != len(shape):
        raise ValueError(f"{name or 'array'}: {len(logical)} logical axes {tuple(logical)} for shape {tuple(shape)}")
    table = dict(rules)
    sizes = {str(k): int(v) for k, v in mesh.shape.items()}
    used: set[str] = set()
    out: list[Any] = []
    for dim, (lname, size) in enumerate(zip(logical, shape)):
        if lname is None:
            out.append(None)
            continue
        if lname not in table:
            raise ValueError(f"{name or 'array'}: logical axis {lname!r} has no mesh rule (rules: {sorted(table)})")
        wanted = tuple(a for a in table[lname] if sizes.get(a, 1) > 1 and a not in used)
        axes = list(wanted)
        while axes and size % math.prod(sizes[a] for a in axes):
            axes.pop()
        if fallbacks is not None and tuple(axes) != wanted:
            fallbacks.append((name, dim, wanted, tuple(axes), int(size)))
        used.update(axes)
        out.append(None if not axes else (axes[0] if len(axes) == 1 else tuple(axes)))
    while out and out[-1] is None:  # canonical form (jit outputs carry P('x') for P('x', None)): one cache key
        out.pop()
    return PartitionSpec(*out)


def sharding_plan(named_shapes: Mapping[str, Sequence[int]], mesh: Mesh,
                  rules: Sequence[tuple[str, tuple[str, ...]]] = LOGICAL_RULES) -> ShardingPlan:
    """Apply :data:`PARAM_RULES` and ``rules`` to ``{hf_name: shape}``.

    Returns:
      a :class:`ShardingPlan` (specs for every name; fallbacks and unmatched names listed).
    """
    specs, logical, fallbacks, unmatched = {}, {}, [], []
    for name, shape in named_shapes.items():
        ax = param_logical_axes(name, len(shape))
        logical[name] = ax
        if ax is None:
            unmatched.append(name)
            specs[name] = PartitionSpec()
        else:
            specs[name] = logical_to_spec(ax, shape, mesh, rules, fallbacks, name)
    return ShardingPlan(specs, logical, fallbacks, unmatched)


def _name(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def state_shardings(state: nnx.State, mesh: Mesh, rules: Sequence[tuple[str, tuple[str, ...]]] = LOGICAL_RULES,
                    plan_out: list | None = None) -> nnx.State:
    """``NamedSharding`` for every variable of a model's ``nnx.State`` (same tree structure: each Variable's value
    replaced by its sharding), from the HF path of each variable.

    Args:
      state: ``nnx.state(model)`` (concrete or abstract: only shapes are read).
      mesh: the mesh.
      rules: logical -> mesh table.
      plan_out: optional list; the :class:`ShardingPlan` is appended to it.

    Returns:
      an ``nnx.State`` usable as ``in_shardings`` / ``jax.device_put`` target for ``state``.
    """
    flat = list(nnx.to_flat_state(state))
    shapes = {_name(p): tuple(_value(v).shape) for p, v in flat}
    plan = sharding_plan(shapes, mesh, rules)
    if plan_out is not None:
        plan_out.append(plan)
    return nnx.map_state(lambda p, v: _replace(v, NamedSharding(mesh, plan.specs[_name(p)])), state)


def optimizer_shardings(opt_state: nnx.State, model_shardings: nnx.State, mesh: Mesh) -> nnx.State:
    """Shardings for an ``nnx.Optimizer`` state: every leaf whose path ends with a parameter's path and has that
    parameter's shape (AdamW ``mu``/``nu``, any optax per-parameter state) is sharded like the parameter; the rest
    (counts, the step, loss-scale scalars) is replicated.

    Args:
      opt_state: ``nnx.state(optimizer)``.
      model_shardings: :func:`state_shardings` of the model's state.
      mesh: the mesh.

    Returns:
      an ``nnx.State`` with ``opt_state``'s structure and ``NamedSharding`` values.
    """
    by_path = {tuple(p): _value(v) for p, v in nnx.to_flat_state(model_shardings)}
    replicated = NamedSharding(mesh, PartitionSpec())

    def pick(path, var):
        path = tuple(path)
        shape = tuple(getattr(_value(var), "shape", ()))
        for i in range(len(path)):
            sh = by_path.get(path[i:])
            if sh is not None:
                spec = sh.spec
                if len(spec) <= len(shape):
                    return _replace(var, sh)
        return _replace(var, replicated) if shape is not None else var

    return nnx.map_state(pick, opt_state)


def batch_sharding(mesh: Mesh, shape: Sequence[int], batch_dim: int = 0,
                   rules: Sequence[tuple[str, tuple[str, ...]]] = LOGICAL_RULES) -> NamedSharding:
    """``NamedSharding`` of a batch array: dimension ``batch_dim`` on the ``batch`` rule's mesh axes (with the
    divisibility fallback), the rest replicated."""
    logical = [None] * len(shape)
    logical[batch_dim] = "batch"
    return NamedSharding(mesh, logical_to_spec(logical, shape, mesh, rules))


def batch_axes(mesh: Mesh, rows: int, rules: Sequence[tuple[str, tuple[str, ...]]] = LOGICAL_RULES) -> tuple:
    """The mesh axes a batch of ``rows`` rows is split over (after the divisibility fallback); () = replicated."""
    spec = logical_to_spec(["batch"], [rows], mesh, rules)[0]
    return () if spec is None else ((spec,) if isinstance(spec, str) else tuple(spec))


def shard_state(state: Any, shardings: Any) -> Any:
    """``jax.device_put(state, shardings)``: moves (or reshards) every array; host numpy goes straight to shards."""
    return jax.device_put(state, shardings)


def _value(v):
    return v.get_value() if isinstance(v, nnx.Variable) else v


def _replace(v, new):
    return v.replace(new) if isinstance(v, nnx.Variable) else new
