"""Optimizer-state offload: move the AdamW moments to host memory while the rollout runs, and back for the update.

During a colocated rollout the optimizer state (two float32 moments per parameter: 8 bytes/param, 64 GB for an
8B model before sharding) sits idle in accelerator memory that the engine's KV cache could use. With
``train.offload_optimizer`` the trainer moves every optimizer-state array to the device's host memory space
(``memory_kind="pinned_host"``, the page-locked host memory JAX's GPU client copies to and from with DMA) before
the rollout and back to ``"device"`` before the train step, keeping each array's sharding (mesh, partition spec),
so the compiled train step sees exactly the arrays it was compiled for and the update is bit for bit the one
without offload (tested). This follows tunix's ``rl_cluster`` offload of the optimizer state between roles
(JAX memory kinds; ``jax.device_put(x, sharding.with_memory_kind(...))``).

On CPU the host memory spaces are the same RAM, so offload only exercises the code path (and costs a copy).
"""

from __future__ import annotations

import jax
from flax import nnx

HOST = "pinned_host"


def _opt_arrays(optimizer) -> list:
    return [x for x in jax.tree.leaves(nnx.state(optimizer, nnx.OptState)) if isinstance(x, jax.Array)]


def move_optimizer_state(optimizer, memory_kind: str) -> int:
    """Move every optimizer-state array to ``memory_kind``, keeping its sharding otherwise (``nnx.update`` of the
    optimizer with the moved arrays).

    Args:
      optimizer: an ``nnx.Optimizer``.
      memory_kind: ``"pinned_host"`` (offload) or ``"device"`` (back); any memory kind the arrays' devices list in
        ``device.addressable_memories()``.

    Returns:
      bytes moved (arrays already in ``memory_kind`` are left alone).

    Raises:
      ValueError: a device of the state has no memory of that kind (names the device and the kinds it has).
    """
    return move_state(optimizer, memory_kind, nnx.OptState, what="optimizer state")


def move_state(module, memory_kind: str, state_filter=nnx.Param, *, what: str = "parameters") -> int:
    """Move every array of ``nnx.state(module, state_filter)`` to ``memory_kind`` (sharding otherwise kept), as
    :func:`move_optimizer_state` does for an optimizer; e.g. the frozen reference policy's parameters between uses
    (:mod:`fp8rl_jax.trainer.reference`).

    Args:
      module: an ``nnx.Module`` (or ``nnx.Optimizer``).
      memory_kind: ``"pinned_host"`` or ``"device"`` (any kind the arrays' devices have).
      state_filter: an nnx filter (default ``nnx.Param``).
      what: how the error message names the state.

    Returns:
      bytes moved (arrays already in ``memory_kind`` are left alone).

    Raises:
      ValueError: a device of the state has no memory of that kind (names the device and the kinds it has).
    """
    moved = [0]

    def move(x):
        if not isinstance(x, jax.Array) or x.sharding.memory_kind == memory_kind:
            return x
        for d in x.sharding.device_set:
            kinds = [m.kind for m in d.addressable_memories()]
            if memory_kind not in kinds:
                raise ValueError(f"device {d} has no {memory_kind!r} memory (it has {kinds}); cannot move the "
                                 f"{what} there")
        moved[0] += int(x.nbytes)
        return jax.device_put(x, x.sharding.with_memory_kind(memory_kind))

    nnx.update(module, jax.tree.map(move, nnx.state(module, state_filter)))
    return moved[0]


def optimizer_memory_kinds(optimizer) -> set[str]:
    """The memory kinds the optimizer-state arrays live in now (e.g. ``{"device"}``)."""
    return {x.sharding.memory_kind for x in _opt_arrays(optimizer)}


def state_memory_kinds(module, state_filter=nnx.Param) -> set[str]:
    """The memory kinds the arrays of ``nnx.state(module, state_filter)`` live in now (e.g. ``{"pinned_host"}``)."""
    return {x.sharding.memory_kind for x in jax.tree.leaves(nnx.state(module, state_filter))
            if isinstance(x, jax.Array)}
