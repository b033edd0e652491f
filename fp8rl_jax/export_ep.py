"""Per-expert export of expert-parallel stacks, on the devices that own each expert (no gather of a stack).

Under expert parallelism a Qwen3-MoE stack ``[E, N, K]`` (and its ``weight_scale_inv [E, n, k]``) is sharded on its
leading axis over the mesh's ``expert`` axis (:mod:`fp8rl_jax.parallel.rules`). Slicing expert ``j`` out of it inside
an XLA program and returning it unsharded makes the SPMD partitioner select the slice on its owner and zero
elsewhere, then all-reduce (sum) across ``expert``: a gather through every device, and one that is not byte-exact
for FP8, since ``-0 + 0 = +0`` drops the sign of an e4m3 negative zero (code ``0x80``, which vLLM's
``per_block_cast_to_fp8`` writes for a tiny negative weight). Here each device instead cuts its own ``E / e``
experts out of its local shard (one small jitted unstack per shard, no arithmetic) and each expert's tensor is
assembled on its owners only: a :class:`jax.sharding.NamedSharding` over the sub-mesh of that expert group, sharded
over the remaining axes exactly as the stack was (``fsdp`` / ``tensor``). The bytes are the stack's, bit for bit.
vLLM's expert-parallel loading (``FusedMoE`` with ``enable_expert_parallel``) reads the same per-expert names.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from fp8rl_jax.models.experts import expert_names


@functools.partial(jax.jit, static_argnames=("n",))
def _unstack(x, n: int):
    return tuple(x[i] for i in range(n))


def leading_axis_sharded(x) -> bool:
    """Whether ``x`` is a fully addressable jax array sharded (by a ``NamedSharding``) on its leading axis."""
    sh = getattr(x, "sharding", None)
    return (isinstance(sh, NamedSharding) and not sh.is_fully_replicated and len(sh.spec) > 0
            and sh.spec[0] is not None and getattr(x, "is_fully_addressable", False))


def split_stack_on_owners(name: str, x) -> dict[str, jax.Array]:
    """``{per-expert HF name: array}`` for a stacked expert tensor ``x [E, ...]`` (``name`` its stacked name).

    Sharded on its leading axis (:func:`leading_axis_sharded`): each expert's array lives on the devices of its
    expert group, sharded over the other mesh axes as the stack was (no collective). Otherwise: one jitted unstack
    (the arrays where ``x`` is).

    Raises:
      ValueError: ``name`` is not a stacked expert name (:func:`fp8rl_jax.models.experts.expert_names`).
    """
    names = expert_names(name, x.shape[0])
    if not leading_axis_sharded(x):
        return dict(zip(names, _unstack(x, int(x.shape[0]))))
    sh = x.sharding
    mesh, spec = sh.mesh, tuple(sh.spec) + (None,) * (x.ndim - len(sh.spec))
    lead = (spec[0],) if isinstance(spec[0], str) else tuple(spec[0])
    rest_axes = tuple(a for a in mesh.axis_names if a not in lead)
    rest_spec = PartitionSpec(*spec[1:])
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    groups: dict[int, list] = {}
    for s in x.addressable_shards:
        groups.setdefault(int(s.index[0].start or 0), []).append(s)
    out: dict[str, jax.Array] = {}
    for start, shards in sorted(groups.items()):
        coord = np.argwhere(ids == shards[0].device.id)[0]
        index = tuple(int(coord[i]) if a in lead else slice(None) for i, a in enumerate(mesh.axis_names))
        sub = Mesh(mesh.devices[index], rest_axes)
        target = NamedSharding(sub, rest_spec)
        n_local = int(shards[0].data.shape[0])
        pieces = [_unstack(s.data, n_local) for s in shards]
        for j in range(n_local):
            out[names[start + j]] = jax.make_array_from_single_device_arrays(
                tuple(x.shape[1:]), target, [p[j] for p in pieces])
    return out
