"""Gin settings of the MoE layers' expert-parallel dispatch (``moe.dispatch``, ``moe.all_to_all``,
``moe.capacity_factors``, ``moe.chunk_tokens``): read once by the trainer and its embedded engine, applied by
:func:`fp8rl_jax.models.moe.set_expert_parallel` (the algorithm: :mod:`fp8rl_jax.models.expert_parallel`)."""

from __future__ import annotations

import dataclasses

import gin

from fp8rl_jax.models.expert_parallel import (ALL_TO_ALL_IMPLS, DEFAULT_CAPACITY_FACTORS, DEFAULT_CHUNK_TOKENS, DISPATCHES,
                                              check_chunk_tokens)


@gin.configurable("moe")
@dataclasses.dataclass(frozen=True)
class MoeDispatchConfig:
    """How Qwen3-MoE layers use the mesh's ``expert`` axis.

    Attributes:
      dispatch: ``"auto"`` (= ``"all_to_all"`` when ``mesh.expert > 1``), ``"all_to_all"`` (each device runs its
        ``E / expert`` experts on the rows sent to it: expert parallelism, as Megatron / maxtext / vLLM EP), or
        ``"replicated"`` (every device runs every expert's tiles on its tokens; the axis shards storage only).
      all_to_all: ``"auto"`` (``jax.lax.ragged_all_to_all`` where lowered for CUDA, static ``all_to_all`` buffers
        elsewhere: XLA:CPU has no ragged all-to-all), ``"static"`` or ``"ragged"``.
      capacity_factors: receive capacities (multiples of a device's routed rows) tried before the dropless one;
        they set the work, never the result.
      chunk_tokens: tokens a device dispatches per all-to-all round (0: all at once). It bounds the dispatch
        buffers to ``expert * chunk_tokens * top_k`` rows per device (dropless; the result does not depend on it).

    Raises:
      ValueError: an unknown value (names the valid ones), at construction.
    """

    dispatch: str = "auto"
    all_to_all: str = "auto"
    capacity_factors: tuple = DEFAULT_CAPACITY_FACTORS
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS

    def __post_init__(self):
        if self.dispatch not in DISPATCHES:
            raise ValueError(f"moe.dispatch={self.dispatch!r} is not one of {DISPATCHES}")
        if self.all_to_all not in ALL_TO_ALL_IMPLS:
            raise ValueError(f"moe.all_to_all={self.all_to_all!r} is not one of {ALL_TO_ALL_IMPLS}")
        f = tuple(float(x) for x in self.capacity_factors)
        if not f or any(x <= 0 for x in f) or list(f) != sorted(set(f)):
            raise ValueError(f"moe.capacity_factors must be positive and increasing, got {self.capacity_factors}")
        object.__setattr__(self, "capacity_factors", f)
        check_chunk_tokens(self.chunk_tokens, "moe.chunk_tokens")

    def kwargs(self) -> dict:
        """Keyword arguments of :func:`fp8rl_jax.models.moe.set_expert_parallel` (after ``model, mesh``)."""
        return {"dispatch": self.dispatch, "all_to_all": self.all_to_all, "capacity_factors": self.capacity_factors,
                "chunk_tokens": self.chunk_tokens}
