"""Build a model directly on a mesh: parameters go from host memory (or a jitted init) straight to their shards.

What is achievable with today's loaders: :func:`fp8rl_jax.models.loading.load_checkpoint` reads a whole checkpoint
into host numpy arrays (safetensors / GGUF, dequantized on the host), so one full *host* copy exists while the
model is built. No *device* ever holds a full unsharded copy: the model is first built abstractly
(``nnx.eval_shape``, no memory), each parameter's ``NamedSharding`` comes from :mod:`fp8rl_jax.parallel.rules`, and
``jax.device_put(host_array, sharding)`` copies to each device only the slice it owns. A random init
(``params=None``) runs the initializers under ``jax.jit(..., out_shardings=...)``, so each device computes only its
own shards (maxtext / tunix's sharded init). Streaming from disk shard by shard (no full host copy) would need a
loader that returns lazily readable tensors (``jax.make_array_from_callback`` over memory-mapped safetensors); the
loaders here do not offer that yet.

Qwen3-MoE experts are stacked ``[E, N, K]`` parameters (:mod:`fp8rl_jax.models.experts`) while checkpoints name them
per expert (``mlp.experts.{j}.gate_proj.weight``): each stack is assembled shard by shard with
``jax.make_array_from_callback``, every device receiving only the host slices of the experts (and rows) it owns,
so no full stack is built on any device (nor on the host).
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from fp8rl_jax.models.experts import expert_names, is_expert_stack_name
from fp8rl_jax.parallel.rules import LOGICAL_RULES, ShardingPlan, shard_state, state_shardings


def build_sharded_model(cfg, params: dict[str, Any] | None, mesh: Mesh, *, linear_precision: str = "dense",
                        param_dtype="float32", dtype="float32", seed: int = 0,
                        rules: Sequence[tuple[str, tuple[str, ...]]] = LOGICAL_RULES):
    """A :class:`fp8rl_jax.models.decoder.CausalLM` whose parameters are sharded on ``mesh`` from the start.

    Args:
      cfg: the :class:`fp8rl_jax.models.config.ModelConfig`.
      params: ``{hf_name: array}`` (host numpy or jax arrays), e.g. from ``load_checkpoint``; None = random init
        (the same values as :func:`fp8rl_jax.models.loading.build_model` with this ``seed``).
      mesh: the device mesh (:func:`fp8rl_jax.parallel.mesh.make_mesh`).
      linear_precision, param_dtype, dtype, seed: as :func:`fp8rl_jax.models.loading.build_model`.
      rules: logical -> mesh axes table.

    Returns:
      ``(model, plan)``: the model and the :class:`ShardingPlan` used (divisibility fallbacks listed there).

    Raises:
      KeyError: ``params`` lacks a parameter the model needs (up to five names listed).
      ValueError: a shape mismatch (name, expected and got shapes).
    """
    from fp8rl_jax.models.decoder import CausalLM
    from fp8rl_jax.models.loading import as_dtype

    pd, dt = as_dtype(param_dtype), as_dtype(dtype)

    def make():
        return CausalLM(cfg, linear_precision=linear_precision, param_dtype=pd, dtype=dt, rngs=nnx.Rngs(seed))

    abstract = nnx.eval_shape(make)
    graphdef, state = nnx.split(abstract)
    plans: list[ShardingPlan] = []
    shardings = state_shardings(state, mesh, rules, plan_out=plans)
    if params is None:
        new_state = jax.jit(lambda: nnx.split(make())[1], out_shardings=shardings)()
        return nnx.merge(graphdef, new_state), plans[0]
    flat = list(nnx.to_flat_state(state))
    names = [".".join(str(p) for p in path) for path, _ in flat]
    shapes = {n: tuple((var.get_value() if isinstance(var, nnx.Variable) else var).shape)
              for n, (_, var) in zip(names, flat)}
    # stacked experts given per expert (the HF naming): assembled per shard below, never stacked whole
    per_expert = {n: expert_names(n, shapes[n][0]) for n in names
                  if is_expert_stack_name(n) and n not in params and any(p in params for p in
                                                                          expert_names(n, shapes[n][0]))}
    missing = [n for n in names if n not in params and n not in per_expert]
    missing += [p for parts in per_expert.values() for p in parts if p not in params]
    if missing:
        raise KeyError(f"checkpoint is missing {len(missing)} parameter(s) the model needs, e.g. {missing[:5]}")
    sh_flat = dict((tuple(p), v) for p, v in nnx.to_flat_state(shardings))
    out = []
    for (path, var), name in zip(flat, names):
        want = var.get_value() if isinstance(var, nnx.Variable) else var
        sh = sh_flat[tuple(path)]
        sh = sh.get_value() if isinstance(sh, nnx.Variable) else sh
        if name in per_expert:
            arr = _stack_sharded([params[p] for p in per_expert[name]], per_expert[name], want, sh)
            out.append((path, var.replace(arr) if isinstance(var, nnx.Variable) else arr))
            continue
        arr = params[name]
        if tuple(np.shape(arr)) != tuple(want.shape):
            raise ValueError(f"shape mismatch for {name}: model expects {tuple(want.shape)}, checkpoint has "
                             f"{tuple(np.shape(arr))} (config and weights disagree)")
        host = arr if isinstance(arr, jax.Array) else np.asarray(arr)
        if host.dtype != want.dtype:
            host = host.astype(want.dtype)
        out.append((path, var.replace(jax.device_put(host, sh)) if isinstance(var, nnx.Variable) else
                    jax.device_put(host, sh)))
    return nnx.merge(graphdef, nnx.from_flat_state(out)), plans[0]


def _stack_sharded(parts: list, names: list[str], want, sharding) -> jax.Array:
    """The ``[E, ...]`` stack of ``parts`` (E per-expert arrays) as a global array with ``sharding``.

    Host (numpy) parts: ``jax.make_array_from_callback``, each device gets the stack of only its experts' (and
    rows') slices, cast to ``want.dtype``. JAX-array parts: one jitted ``jnp.stack`` with ``out_shardings``.

    Raises:
      ValueError: a part's shape is not ``want.shape[1:]`` (names it).
    """
    for n, a in zip(names, parts):
        if tuple(np.shape(a)) != tuple(want.shape[1:]):
            raise ValueError(f"shape mismatch for {n}: model expects {tuple(want.shape[1:])}, checkpoint has "
                             f"{tuple(np.shape(a))} (config and weights disagree)")
    if any(isinstance(a, jax.Array) for a in parts):
        return jax.jit(lambda xs: jnp.stack(xs).astype(want.dtype), out_shardings=sharding)(list(parts))
    host = [np.asarray(a) for a in parts]

    def shard(index):
        experts = range(*index[0].indices(len(host)))
        return np.stack([host[j][tuple(index[1:])] for j in experts]).astype(want.dtype)

    return jax.make_array_from_callback(tuple(want.shape), sharding, shard)


def shard_model(model, mesh: Mesh, rules: Sequence[tuple[str, tuple[str, ...]]] = LOGICAL_RULES) -> ShardingPlan:
    """Move an existing model's state onto ``mesh`` by the rules, in place (``jax.device_put`` + ``nnx.update``).

    Use for a model built elsewhere (a full copy existed on one device before this call); prefer
    :func:`build_sharded_model` at load time.

    Returns:
      the :class:`ShardingPlan` used.
    """
    state = nnx.state(model)
    plans: list[ShardingPlan] = []
    sh = state_shardings(state, mesh, rules, plan_out=plans)
    nnx.update(model, shard_state(state, sh))
    return plans[0]


def shard_optimizer(optimizer, model, mesh: Mesh) -> None:
    """Reshard an ``nnx.Optimizer``'s state like ``model``'s parameters (moments) / replicated (counters), in place.

    ``nnx.Optimizer(model, ...)`` creates its moments with ``zeros_like`` of the (already sharded) parameters;
    this makes the placement explicit and identical to the train step's output shardings.
    """
    from fp8rl_jax.parallel.rules import optimizer_shardings

    model_sh = jax.tree.map(lambda x: x.sharding, nnx.state(model))
    opt_state = nnx.state(optimizer)
    nnx.update(optimizer, shard_state(opt_state, optimizer_shardings(opt_state, model_sh, mesh)))
