"""torch / vLLM / Ray side of fp8rl-jax: the only package that imports them.

The vLLM rollout engine, weight-sync transports (DLPack, worker extension, torch.distributed) and the Ray
launcher live here (see the open issue "rollout_bridge: real vLLM workers"); ``fp8rl_jax`` never imports
this package, so the JAX stack runs without torch or vLLM installed.
"""
