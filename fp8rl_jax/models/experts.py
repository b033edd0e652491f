"""Stacked Qwen3-MoE expert weights (issue 19, "scale out"): one ``[E, N, K]`` parameter per projection and layer.

A layer's ``E`` SwiGLU experts are held by :class:`StackedExperts` as three :class:`ExpertLinear` parameters, HF's
per-expert ``[N, K]`` (``[out, in]``) layout stacked on a leading expert axis:

===========================================  ==============================  ======================================
NNX path (in a :class:`CausalLM`)            dense                           FP8 (``linear_precision="fp8"``)
===========================================  ==============================  ======================================
``model.layers.{i}.mlp.experts.gate_proj``   ``weight [E, I, H]``            ``weight`` e4m3 ``[E, I, H]`` +
                                             (``param_dtype``)               ``weight_scale_inv`` float32
                                                                             ``[E, ceil(I/128), ceil(H/128)]``
``...mlp.experts.up_proj``                   ``weight [E, I, H]``            the same
``...mlp.experts.down_proj``                 ``weight [E, H, I]``            e4m3 ``[E, H, I]`` + ``[E, ceil(H/128),
                                                                             ceil(I/128)]``
===========================================  ==============================  ======================================

(``I = moe_intermediate_size``, ``H = hidden_size``.) Slice ``j`` of every stack is exactly expert ``j``'s HF tensor
``model.layers.{i}.mlp.experts.{j}.{gate,up,down}_proj.weight`` (``+ _scale_inv``), so a model has O(layers)
expert variables instead of O(layers x experts) (Qwen3-30B-A3B: 48 x 3 (x 2 in FP8) instead of 18,432 (36,864)),
the grouped matmuls read the stacks as they are (no per-forward stacking), and the sharding rules put the leading
dimension on the ``expert`` mesh axis (:mod:`fp8rl_jax.parallel.rules`).

The outside world keeps the per-expert HF names (safetensors, vLLM, export, checkpoints loaded by name): the
functions below translate between the two namings. :func:`split_expert_stacks` turns stacks into per-expert slices
(what :func:`fp8rl_jax.models.decoder.named_params` returns), :func:`stack_expert_tensors` stacks per-expert
tensors into the stacks (what :func:`fp8rl_jax.models.decoder.load_named_params` and
:func:`fp8rl_jax.parallel.loading.build_sharded_model` do on load, and the rollout engine on a weight update).
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from fp8rl_jax.fp8 import BLOCK_SIZE, E4M3, dequantize_weight_blockwise, w8a8_block_matmul
from fp8rl_jax.models.layers import LINEAR_PRECISIONS, Linear

#: the stacked projections of a layer's experts, in NNX state (sorted) order
EXPERT_PROJECTIONS = ("down_proj", "gate_proj", "up_proj")
#: tensors of one stacked projection (``weight_scale_inv`` in FP8 only)
EXPERT_LEAVES = ("weight", "weight_scale_inv")

_STACK = re.compile(r"^(?P<mod>(?:.*\.)?mlp\.experts)\.(?P<proj>gate_proj|up_proj|down_proj)"
                    r"\.(?P<leaf>weight|weight_scale_inv)$")
_PER_EXPERT = re.compile(r"^(?P<mod>(?:.*\.)?mlp\.experts)\.(?P<j>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)"
                         r"\.(?P<leaf>weight|weight_scale_inv)$")


class ExpertLinear(Linear):
    """``E`` stacked bias-free linears: ``weight [E, N, K]`` (HF ``[out, in]`` per expert), dense or FP8 blockwise.

    Dense: ``weight`` in ``param_dtype``, initialised normal(0.02) with one key per expert (``keys``, so expert
    ``j``'s values equal those of a per-expert :class:`~fp8rl_jax.models.layers.Linear` drawn from the same key).
    FP8: ``weight`` e4m3 ``[E, N, K]`` (zeros) and ``weight_scale_inv`` float32 ``[E, ceil(N/bs), ceil(K/bs)]``
    (ones). It is a :class:`~fp8rl_jax.models.layers.Linear` subclass so that what finds decoder-layer linears by
    type (:func:`fp8rl_jax.trainer.precision.apply_train_precision` setting the FP8 training ``dot_general``)
    finds the experts too; it is not called like one: :meth:`apply` runs one expert, :meth:`stacked_kn` gives the
    ``ragged_dot`` operand.

    Args:
      num_experts, in_features, out_features: ``E``, ``K``, ``N`` (positive).
      precision: ``"dense"`` or ``"fp8"``.
      param_dtype, dtype: storage dtype of dense weights, compute dtype.
      keys: ``E`` PRNG keys, a ``[E]`` key array or a sequence (dense only; ignored in FP8).
      block_size: FP8 weight block edge (128).

    Raises:
      ValueError: unknown precision, non-positive sizes, or (dense) not ``E`` keys.
    """

    def __init__(self, num_experts: int, in_features: int, out_features: int, *, precision: str = "dense",
                 param_dtype=jnp.float32, dtype=jnp.float32, keys: jax.Array | Sequence[jax.Array] | None = None,
                 block_size: int = BLOCK_SIZE):
        if precision not in LINEAR_PRECISIONS:
            raise ValueError(f"linear precision {precision!r} not in {LINEAR_PRECISIONS}")
        if min(num_experts, in_features, out_features) <= 0:
            raise ValueError(f"ExpertLinear needs positive sizes, got num_experts={num_experts}, "
                             f"in_features={in_features}, out_features={out_features}")
        self.precision, self.dtype, self.block_size = precision, dtype, block_size
        self.num_experts = num_experts
        self.dot_general = None  # as Linear: a training-precision product (FP8 training), None = einsum
        self.bias = None
        if precision == "fp8":
            self.weight = nnx.Param(jnp.zeros((num_experts, out_features, in_features), E4M3))
            self.weight_scale_inv = nnx.Param(jnp.ones(
                (num_experts, math.ceil(out_features / block_size), math.ceil(in_features / block_size)),
                jnp.float32))
        else:
            if keys is None or len(keys) != num_experts:
                raise ValueError(f"a dense ExpertLinear needs {num_experts} PRNG keys, got "
                                 f"{None if keys is None else len(keys)}")
            init = nnx.initializers.normal(0.02)
            keys = keys if isinstance(keys, jax.Array) else jnp.stack(list(keys))
            self.weight = nnx.Param(jax.vmap(lambda k: init(k, (out_features, in_features), param_dtype))(keys))

    def __call__(self, x: jax.Array) -> jax.Array:
        raise TypeError("ExpertLinear holds E experts: use apply(x, j) for one expert or stacked_kn() for "
                        "jax.lax.ragged_dot")

    def apply(self, x: jax.Array, j: int) -> jax.Array:
        """Expert ``j``'s product ``x [..., K] -> [..., N]``: exactly a per-expert ``Linear`` with slice ``j``.

        FP8: :func:`fp8rl_jax.fp8.w8a8_block_matmul` on ``weight[j]`` / ``weight_scale_inv[j]``; dense with a
        ``dot_general`` set: ``dot_general(x, weight[j], contract K)`` in ``dtype``; else an einsum in ``dtype``.
        """
        if self.precision == "fp8":
            return w8a8_block_matmul(x, self.weight[...][j], self.weight_scale_inv[...][j], self.block_size,
                                     out_dtype=self.dtype)
        if self.dot_general is not None:
            xd = x.astype(self.dtype)
            return self.dot_general(xd, self.weight[...][j].astype(self.dtype), (((xd.ndim - 1,), (1,)), ((), ())))
        return jnp.einsum("...k,nk->...n", x.astype(self.dtype), self.weight[...][j].astype(self.dtype))

    def stacked_kn(self, dtype) -> jax.Array:
        """The ``[E, K, N]`` right operand of :func:`jax.lax.ragged_dot` in ``dtype``: the dense stack cast, or the
        FP8 stack dequantized blockwise in float32 (:func:`fp8rl_jax.fp8.dequantize_weight_blockwise`)."""
        if self.precision == "fp8":
            w = dequantize_weight_blockwise(self.weight[...], self.weight_scale_inv[...], self.block_size,
                                            out_dtype=jnp.float32)
        else:
            w = self.weight[...].astype(dtype)
        return jnp.swapaxes(w, 1, 2)


def _param_keys(rngs: nnx.Rngs, n: int) -> jax.Array:
    """``n`` successive ``rngs.params()`` keys as one ``[n]`` key array, drawn in one vectorized ``fold_in``.

    An NNX ``RngStream`` call is ``fold_in(key, count); count += 1`` (flax ``nnx.rnglib.RngStream.__call__``), so
    the keys are ``fold_in(key, count + i)`` for ``i < n``; the count then advances by ``n``. Drawing them one by
    one costs a traced NNX state update each: ~2 s per Qwen3-30B-A3B layer under ``nnx.eval_shape`` (384 draws),
    which made planning slow. Streams without that structure fall back to ``n`` calls.
    """
    stream = rngs.params
    key, count = getattr(stream, "key", None), getattr(stream, "count", None)
    if isinstance(key, nnx.Variable) and isinstance(count, nnx.Variable):
        base, c0 = key[...], count[...]
        keys = jax.vmap(lambda c: jax.random.fold_in(base, c))(c0 + jnp.arange(n, dtype=c0.dtype))
        count[...] = c0 + n
        return keys
    return jnp.stack([rngs.params() for _ in range(n)])


class StackedExperts(nnx.Module):
    """A Qwen3-MoE layer's experts: stacked SwiGLU ``down_proj(silu(gate_proj(x)) * up_proj(x))`` per expert.

    Parameters (see the module docstring): ``gate_proj.weight`` / ``up_proj.weight`` ``[E, I, H]``,
    ``down_proj.weight`` ``[E, H, I]`` (+ ``weight_scale_inv`` in FP8), NNX path ``mlp.experts.*``. A dense init
    draws, for ``j = 0..E-1``, expert ``j``'s gate, up and down keys from ``rngs.params()`` in that order, as the
    former one-:class:`~fp8rl_jax.models.layers.MLP`-per-expert layout did (same values for the same seed).

    Args:
      num_experts: ``E``. hidden_size: ``H``. intermediate_size: ``I`` (``moe_intermediate_size``).
      linear_precision: ``"dense"`` or ``"fp8"``. param_dtype, dtype: as :class:`ExpertLinear`.
      rngs: ``nnx.Rngs`` (dense init).

    Raises:
      ValueError: non-positive sizes or unknown precision.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, linear_precision: str,
                 param_dtype, dtype, rngs: nnx.Rngs):
        if min(num_experts, hidden_size, intermediate_size) <= 0:
            raise ValueError(f"StackedExperts needs positive sizes, got num_experts={num_experts}, "
                             f"hidden_size={hidden_size}, intermediate_size={intermediate_size}")
        dense = linear_precision == "dense"
        keys = _param_keys(rngs, 3 * num_experts).reshape(num_experts, 3) if dense else None
        lin = dict(precision=linear_precision, param_dtype=param_dtype, dtype=dtype)
        self.num_experts = num_experts
        self.gate_proj = ExpertLinear(num_experts, hidden_size, intermediate_size,
                                      keys=keys[:, 0] if dense else None, **lin)
        self.up_proj = ExpertLinear(num_experts, hidden_size, intermediate_size,
                                    keys=keys[:, 1] if dense else None, **lin)
        self.down_proj = ExpertLinear(num_experts, intermediate_size, hidden_size,
                                      keys=keys[:, 2] if dense else None, **lin)

    def expert(self, j: int, x: jax.Array) -> jax.Array:
        """Expert ``j``'s SwiGLU on ``x [..., H] -> [..., H]`` (what a per-expert ``MLP`` computed)."""
        g, u = self.gate_proj.apply(x, j), self.up_proj.apply(x, j)
        return self.down_proj.apply(jax.nn.silu(g) * u, j)


# --- naming: stacked NNX names <-> per-expert HF names -------------------------------------------------------------

def is_expert_stack_name(name: str) -> bool:
    """True for a stacked expert tensor name (``...mlp.experts.gate_proj.weight``, ``..._scale_inv``)."""
    return bool(_STACK.match(name))


def expert_names(stack_name: str, num_experts: int) -> list[str]:
    """The per-expert HF names of a stack: ``...mlp.experts.{j}.gate_proj.weight`` for ``j < num_experts``.

    Raises:
      ValueError: ``stack_name`` is not a stacked expert name.
    """
    m = _STACK.match(stack_name)
    if not m:
        raise ValueError(f"{stack_name!r} is not a stacked expert tensor name (...mlp.experts.<proj>.<leaf>)")
    return [f"{m['mod']}.{j}.{m['proj']}.{m['leaf']}" for j in range(num_experts)]


def _expert_name(stack_name: str, j: int) -> str:
    m = _STACK.match(stack_name)
    return f"{m['mod']}.{j}.{m['proj']}.{m['leaf']}"


def expert_stack_of(name: str) -> tuple[str, int] | None:
    """``(stack name, j)`` of a per-expert HF name (``...experts.3.up_proj.weight`` -> ``(...experts.up_proj.weight,
    3)``), or None for any other name."""
    m = _PER_EXPERT.match(name)
    if not m:
        return None
    return f"{m['mod']}.{m['proj']}.{m['leaf']}", int(m["j"])


def split_expert_names(shapes: Mapping[str, Sequence[int]]) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` with every stack replaced by its per-expert names and ``shape[1:]`` (order as
    :func:`split_expert_stacks`; no arrays needed)."""
    wrapped = {k: jax.ShapeDtypeStruct(tuple(s), jnp.float32) for k, s in shapes.items()}
    split = split_expert_stacks(wrapped, slicer=lambda a, j: jax.ShapeDtypeStruct(tuple(a.shape[1:]), a.dtype))
    return {k: tuple(v.shape) for k, v in split.items()}


def split_expert_stacks(tensors: Mapping[str, Any],
                        slicer: Callable[[Any, int], Any] = lambda a, j: a[j]) -> dict[str, Any]:
    """Replace every stacked expert tensor by its per-expert slices under the HF names.

    The order is that of the former per-expert layout's NNX state: the stacks of one ``...mlp.experts`` module
    (which are adjacent in state order) become, at the position of the first, ``experts.0.down_proj.weight``,
    ``experts.0.down_proj.weight_scale_inv``, ``experts.0.gate_proj.weight``, ..., ``experts.1.down_proj.weight``,
    ...; other tensors keep their place. Traceable; eagerly each slice is a copy.

    Args:
      tensors: ``{name: array [E, ...]}`` for stacks, anything else passes through.
      slicer: ``(stack, j) -> slice j`` (default ``a[j]``).

    Returns:
      ``{name: array}`` with per-expert names only.

    Raises:
      ValueError: the stacks of one experts module disagree on ``E``.
    """
    out: dict[str, Any] = {}
    groups: dict[str, list[str]] = {}
    for name in tensors:
        m = _STACK.match(name)
        if m:
            groups.setdefault(m["mod"], []).append(name)
    done: set[str] = set()
    for name, arr in tensors.items():
        m = _STACK.match(name)
        if not m:
            out[name] = arr
            continue
        mod = m["mod"]
        if mod in done:
            continue
        done.add(mod)
        stacks = sorted(groups[mod], key=lambda n: (EXPERT_PROJECTIONS.index(_STACK.match(n)["proj"]),
                                                    EXPERT_LEAVES.index(_STACK.match(n)["leaf"])))
        counts = {int(tensors[s].shape[0]) for s in stacks}
        if len(counts) != 1:
            raise ValueError(f"{mod}: stacked expert tensors disagree on the number of experts "
                             f"{ {s: tuple(tensors[s].shape) for s in stacks} }")
        (e,) = counts
        for j in range(e):
            for s in stacks:
                out[_expert_name(s, j)] = slicer(tensors[s], j)
    return out


def stack_expert_tensors(tensors: Mapping[str, Any], stack_shapes: Mapping[str, Sequence[int]], *,
                         stack: Callable[[list], Any] = jnp.stack) -> dict[str, Any]:
    """Replace per-expert HF tensors by their stacks for each stack of ``stack_shapes`` given per expert.

    A stack already present under its stacked name is passed through (its per-expert names, if also present, are
    dropped); a stack none of whose per-expert names are present is left out (the caller reports it missing).

    Args:
      tensors: ``{name: array}`` (numpy or jax; per-expert names ``...mlp.experts.{j}.<proj>.<leaf>``).
      stack_shapes: ``{stack name: full stack shape [E, ...]}`` the model holds.
      stack: how to stack a list of ``E`` per-expert arrays (default :func:`jax.numpy.stack`; e.g. ``np.stack``
        for host arrays).

    Returns:
      ``{name: array}`` with stacks in place of their per-expert tensors (other names unchanged, in order).

    Raises:
      KeyError: a stack's per-expert tensors are only partly present (the missing names, up to five).
      ValueError: a per-expert tensor's shape is not the stack's ``shape[1:]`` (names it, both shapes).
    """
    out = dict(tensors)
    for sname, shape in stack_shapes.items():
        names = expert_names(sname, int(shape[0]))
        have = [n in out for n in names]
        if sname in out:
            for n in names:
                out.pop(n, None)
            continue
        if not any(have):
            continue
        if not all(have):
            missing = [n for n, h in zip(names, have) if not h]
            raise KeyError(f"checkpoint is missing {len(missing)} expert tensor(s) of {sname}, e.g. {missing[:5]}")
        parts = [out.pop(n) for n in names]
        for n, a in zip(names, parts):
            if tuple(a.shape) != tuple(shape[1:]):
                raise ValueError(f"shape mismatch for {n}: model expects {tuple(shape[1:])}, checkpoint has "
                                 f"{tuple(a.shape)} (config and weights disagree)")
        out[sname] = stack(parts)
    return out
