"""How the trainer configures its model's kernels for a run: one function shared by the trainer and the planner.

:func:`configure_train_model` applies a :class:`fp8rl_jax.trainer.config.TrainConfig`'s attention implementation,
MoE expert implementation and training precision to a :class:`fp8rl_jax.models.decoder.CausalLM`, as
:class:`fp8rl_jax.trainer.loop.RLTrainer` runs it, so ``scripts/plan.py`` and ``scripts/compile_h100.py`` compile the
trainer's own program.
"""

from __future__ import annotations

import functools

from flax import nnx

from fp8rl_jax.models.moe import set_expert_impl, set_expert_parallel
from fp8rl_jax.parallel.mesh import mesh_shape_of
from fp8rl_jax.parallel.moe_dispatch import MoeDispatchConfig
from fp8rl_jax.parallel.rules import batch_sharding
from fp8rl_jax.trainer.precision import apply_train_precision


def configure_train_model(model, config, model_cfg, mesh=None) -> str:
    """Set the training forward's attention and expert implementations and its precision on ``model`` (in place).

    Attention (:mod:`fp8rl_jax.models.attention_impl`): ``config.attention_implementation``, except that ``"auto"``
    becomes ``"xla"`` on a mesh whose ``tensor`` axis does not divide the KV heads (cuDNN needs q, k and v sharded
    alike; such KV heads are replicated). On a mesh every attention module also gets ``qkv_sharding``, the batch
    sharding of the mesh (:func:`fp8rl_jax.parallel.rules.batch_sharding`), which the cuDNN path imposes on q, k and
    v: cuDNN's custom partitioner refuses differently sharded operands ("Query, key and value should have same
    sharding", found by the deviceless fsdp=8 compile of scripts/compile_h100.py), and XLA's propagation need not
    give them one sharding. Experts: :func:`fp8rl_jax.models.moe.set_expert_impl` (``config.expert_impl``) and, on a mesh with
    ``expert > 1``, the expert-parallel dispatch of gin's ``moe.*`` (:func:`fp8rl_jax.models.moe.set_expert_parallel`,
    :class:`fp8rl_jax.parallel.moe_dispatch.MoeDispatchConfig`). Precision:
    :func:`fp8rl_jax.trainer.precision.apply_train_precision` (``config.train_precision``, ``fp8_train_grad``).

    Args:
      model: the trainer's ``CausalLM`` (concrete or under ``nnx.eval_shape``).
      config: the run's ``TrainConfig``.
      model_cfg: the model's ``ModelConfig``.
      mesh: the trainer's mesh, or None (one device).

    Returns:
      the attention implementation set.

    Raises:
      ValueError: as ``apply_train_precision`` / ``set_expert_impl`` (bad settings, pre-quantized linears).
    """
    attn_impl = config.attention_implementation
    tensor = dict(mesh_shape_of(mesh)).get("tensor", 1) if mesh is not None else 1
    if attn_impl == "auto" and model_cfg.num_key_value_heads % tensor:
        attn_impl = "xla"
    qkv_sharding = functools.partial(batch_sharding, mesh) if mesh is not None else None
    for _, mod in nnx.iter_graph(model):
        if hasattr(mod, "attention_implementation"):
            mod.attention_implementation = attn_impl
            mod.qkv_sharding = qkv_sharding
    set_expert_impl(model, config.expert_impl)
    set_expert_parallel(model, mesh, **MoeDispatchConfig().kwargs())
    apply_train_precision(model, config.train_precision, fp8_grad=config.fp8_train_grad)
    return attn_impl
