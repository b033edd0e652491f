"""Device mesh and sharding rules for the trainer (issue 19).

* :mod:`fp8rl_jax.parallel.mesh`: the gin-configurable mesh (``mesh.shape = "fsdp=4,tensor=2"``), axes
  ``data`` / ``fsdp`` / ``tensor`` / ``expert``.
* :mod:`fp8rl_jax.parallel.rules`: HF parameter name -> logical axes -> mesh axes -> ``NamedSharding`` (the one
  place the rules live), batch and optimizer-state shardings.
* :mod:`fp8rl_jax.parallel.loading`: build a model sharded from the start; reshard a model / optimizer.
"""

from fp8rl_jax.parallel.mesh import MESH_AXES, MeshConfig, format_mesh_shape, make_mesh, mesh_from, parse_mesh_shape
from fp8rl_jax.parallel.rules import (LOGICAL_RULES, PARAM_RULES, ShardingPlan, batch_axes, batch_sharding,
                                      logical_to_spec, optimizer_shardings, param_logical_axes, sharding_plan,
                                      state_shardings)

__all__ = ["MESH_AXES", "MeshConfig", "format_mesh_shape", "make_mesh", "mesh_from", "parse_mesh_shape",
           "LOGICAL_RULES", "PARAM_RULES", "ShardingPlan", "batch_axes", "batch_sharding", "logical_to_spec",
           "optimizer_shardings", "param_logical_axes", "sharding_plan", "state_shardings"]
