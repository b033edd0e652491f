"""torch / vLLM / Ray side of fp8rl-jax: the only package that imports them.

- :mod:`rollout_bridge.dlpack`: JAX -> torch zero-copy (DLPack); an export as the tensors vLLM reloads.
- :mod:`rollout_bridge.transports`: weight sync in-process, over shared memory / CUDA IPC buckets, or by
  ``torch.distributed`` broadcast (gloo / NCCL), with :class:`WeightSyncError` on any failure.
- :mod:`rollout_bridge.vllm_worker`: the vLLM worker extension that receives and reloads weights + KV scales.
- :mod:`rollout_bridge.vllm_engine`: :class:`VllmRolloutEngine`, the ``RolloutEngine`` over ``vllm.LLM``.
- :mod:`rollout_bridge.ray_launch`: trainer and rollout actors on Ray (placement groups, cluster launch).

``fp8rl_jax`` never imports this package at module import; the trainer imports :func:`make_engine` lazily when
``train.rollout_engine = "vllm"``. Attributes are resolved lazily here too, so ``import rollout_bridge`` does not
import vLLM. See docs/ROLLOUT_BRIDGE.md.
"""

from __future__ import annotations

_LAZY = {
    "VllmRolloutEngine": "rollout_bridge.vllm_engine",
    "make_engine": "rollout_bridge.vllm_engine",
    "WeightSyncError": "rollout_bridge.transports",
    "make_transport": "rollout_bridge.transports",
    "jax_to_torch": "rollout_bridge.dlpack",
    "vllm_tensors": "rollout_bridge.dlpack",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    """Import the submodule that defines ``name`` on first use (PEP 562)."""
    if name not in _LAZY:
        raise AttributeError(f"module 'rollout_bridge' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_LAZY[name]), name)
