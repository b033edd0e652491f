"""Multi-process (multi-host) JAX: one process per host joined with ``jax.distributed.initialize``.

Configured by gin (``distributed.coordinator_address`` / ``num_processes`` / ``process_id``) or the flags of
``scripts/train.py`` (``--coordinator_address``, ``--num_processes``, ``--process_id``); the Ray launcher sets them
from the Ray head (see :mod:`rollout_bridge.ray_launch`). After :func:`initialize`, ``jax.devices()`` lists every
process's devices, so a mesh built from it (:mod:`fp8rl_jax.parallel.mesh`) spans the hosts and the train step runs
SPMD across them: each process feeds the same host batch (``jax.device_put`` of identical values onto a global
sharding) and XLA's collectives (NCCL on GPU; gloo on CPU, selected here) reduce the gradients.

Source: JAX "Multi-process environments" (``jax.distributed.initialize``, ``jax.experimental.multihost_utils``);
maxtext's ``max_utils.maybe_initialize_jax_distributed_system``.
"""

from __future__ import annotations

import dataclasses

import gin
import jax


@gin.configurable("distributed")
@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """Where this process sits in a multi-process job.

    Attributes:
      coordinator_address: ``"host:port"`` of process 0's coordinator service; None = single process.
      num_processes: processes in the job (>= 1).
      process_id: this process's index in ``[0, num_processes)``.
      local_device_ids: devices of this host that this process owns (None: all; on CPU one device per process).
      initialization_timeout_s: how long to wait for the other processes.

    Raises:
      ValueError: ``num_processes < 1``, ``process_id`` out of range, or ``num_processes > 1`` without a coordinator.
    """

    coordinator_address: str | None = None
    num_processes: int = 1
    process_id: int = 0
    local_device_ids: tuple | None = None
    initialization_timeout_s: int = 300

    def __post_init__(self):
        if not isinstance(self.num_processes, int) or self.num_processes < 1:
            raise ValueError(f"distributed.num_processes must be a positive int, got {self.num_processes!r}")
        if not isinstance(self.process_id, int) or not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"distributed.process_id must be in [0, {self.num_processes}), got {self.process_id!r}")
        if self.num_processes > 1 and not self.coordinator_address:
            raise ValueError("distributed.num_processes > 1 needs distributed.coordinator_address ('host:port' of "
                             "process 0)")

    @property
    def enabled(self) -> bool:
        """True for a multi-process job."""
        return self.num_processes > 1


_INITIALIZED: DistributedConfig | None = None


def initialize(config: DistributedConfig | None = None) -> bool:
    """Join the multi-process job described by ``config`` (default: the gin-bound one); a no-op for one process.

    Must run before any JAX computation in the process. On CPU it selects gloo cross-process collectives
    (``jax_cpu_collectives_implementation``), which XLA's CPU client needs for collectives across processes.

    Returns:
      True if ``jax.distributed.initialize`` ran (now or in an earlier call with the same config).

    Raises:
      RuntimeError: called again with a different config, or the coordinator could not be reached in time (JAX's
        error, with the address named).
    """
    global _INITIALIZED
    cfg = config if config is not None else DistributedConfig()
    if not cfg.enabled:
        return False
    if _INITIALIZED is not None:
        if _INITIALIZED != cfg:
            raise RuntimeError(f"jax.distributed is already initialized with {_INITIALIZED}, not {cfg}")
        return True
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(coordinator_address=cfg.coordinator_address, num_processes=cfg.num_processes,
                                   process_id=cfg.process_id,
                                   local_device_ids=list(cfg.local_device_ids) if cfg.local_device_ids else None,
                                   initialization_timeout=cfg.initialization_timeout_s)
    except Exception as e:  # noqa: BLE001 - JAX raises XlaRuntimeError/RuntimeError variants; name the address
        raise RuntimeError(f"process {cfg.process_id}/{cfg.num_processes} could not join the job at "
                           f"{cfg.coordinator_address}: {type(e).__name__}: {str(e).splitlines()[0]}") from e
    _INITIALIZED = cfg
    return True


def is_primary() -> bool:
    """True in process 0 (the one that writes metrics, plots and summaries)."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Wait until every process reached ``name`` (no-op for one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def to_host(x):
    """A (possibly multi-process) jax.Array as numpy: the whole value, on every process.

    A fully addressable array is read directly; a replicated one from this process's copy; a sharded one is
    gathered from every process (``multihost_utils.process_allgather(tiled=True)``).
    """
    import numpy as np

    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(x)
    if x.sharding.is_fully_replicated:
        return np.asarray(x.addressable_data(0))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def process_prompt_slice(num_prompts: int) -> tuple[int, int] | None:
    """This process's contiguous share ``[lo, hi)`` of a step's ``num_prompts`` prompts, or None.

    None when there is one process, or when ``num_prompts`` does not divide by the process count (every process
    then generates the whole batch, as before the split; the trainer warns once).
    """
    nproc = jax.process_count()
    if nproc == 1 or num_prompts % nproc:
        return None
    per = num_prompts // nproc
    lo = jax.process_index() * per
    return lo, lo + per


def gather_rollout(local, prompts, first_prompt: int):
    """Every process's :class:`~fp8rl_jax.rollout.types.RolloutBatch` slice, concatenated in prompt order.

    Each process generated ``prompts[first_prompt:first_prompt + U]`` (``n`` samples each, the same ``U`` on every
    process: :func:`process_prompt_slice`); one ``multihost_utils.process_allgather(tiled=True)`` of a few arrays
    gives every process the whole batch: ``response_token_ids`` / ``rollout_logprobs`` / ``response_mask``
    ``[N, T]``, ``finish_reason``, ``prompt_index`` (into ``prompts``), and for an MoE engine the R3 routing record
    (``routed_experts [N, T, L, k]``; ``prompt_routed_experts`` padded with -1 to the longest prompt for the
    collective and sliced back). Exact: integers and float32 values travel unchanged.

    Args:
      local: this process's RolloutBatch (``prompt_index`` local to its slice).
      prompts: the step's whole prompt list (the same on every process).
      first_prompt: index in ``prompts`` of this process's first prompt.

    Returns:
      The whole step's RolloutBatch (same on every process).

    Source: JAX ``jax.experimental.multihost_utils.process_allgather``.
    """
    import numpy as np
    from jax.experimental import multihost_utils

    from fp8rl_jax.rollout.types import RolloutBatch

    arrays = {"response_token_ids": np.asarray(local.response_token_ids, np.int32),
              "rollout_logprobs": np.asarray(local.rollout_logprobs, np.float32),
              "response_mask": np.asarray(local.response_mask, np.float32),
              "stopped": np.array([r == "stop" for r in local.finish_reason], np.int32),
              "prompt_index": np.asarray(local.prompt_index, np.int32) + np.int32(first_prompt)}
    if local.routed_experts is not None:
        arrays["routed_experts"] = np.asarray(local.routed_experts, np.int32)
    if local.prompt_routed_experts is not None:
        longest = max(len(p) for p in prompts)
        first = local.prompt_routed_experts[0]
        padded = np.full((len(local.prompt_routed_experts), longest) + tuple(first.shape[1:]), -1, np.int32)
        for i, r in enumerate(local.prompt_routed_experts):
            padded[i, :len(r)] = r
        arrays["prompt_routed_experts"] = padded
    g = {k: np.asarray(v) for k, v in multihost_utils.process_allgather(arrays, tiled=True).items()}
    index = g["prompt_index"].astype(np.int32)
    rows = [list(prompts[int(i)]) for i in index]
    prompt_routed = None
    if "prompt_routed_experts" in g:
        prompt_routed = [g["prompt_routed_experts"][i, :len(r)].astype(np.int32) for i, r in enumerate(rows)]
    return RolloutBatch(prompt_token_ids=rows, response_token_ids=g["response_token_ids"].astype(np.int32),
                        rollout_logprobs=g["rollout_logprobs"].astype(np.float32),
                        response_mask=g["response_mask"].astype(np.float32),
                        finish_reason=["stop" if s else "length" for s in g["stopped"]], prompt_index=index,
                        weights_version=local.weights_version,
                        routed_experts=g["routed_experts"].astype(np.int32) if "routed_experts" in g else None,
                        prompt_routed_experts=prompt_routed)
