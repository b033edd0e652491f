"""The reference policy of the KL loss term (``LossConfig.use_kl_loss``): the initial policy, frozen.

verl's ``actor_rollout_ref.ref`` is a second copy of the initial weights whose log-probs of each batch's responses
are computed once, before the updates (``compute_ref_log_prob``), and fed to the actor's KL term. Here
:class:`ReferencePolicy` is built by :class:`fp8rl_jax.trainer.loop.RLTrainer` from its model right after loading,
before any update, and never changes:

* ``train.ref_precision = "train"`` (default): a copy of the initial float32 master parameters, run with the
  trainer's own forward (its compute dtype and training precision, e.g. the FP8 training matmuls under
  ``train_precision="fp8"``). Before the first update the reference equals the policy, so ``actor/kl_loss`` of step
  1 is 0 (on-policy). Costs one more copy of the master parameters.
* ``train.ref_precision = "fp8"``: the initial weights exported as the FP8 rollout engine holds them (W8A8 blockwise
  e4m3 decoder linears, bf16 elsewhere: :func:`fp8rl_jax.export.export_weights` ``"fp8_blockwise"``) in a
  ``CausalLM`` with FP8 linears (:mod:`fp8rl_jax.fp8.linear`): about a quarter of the float32 copy's memory. Its
  log-probs carry the FP8 quantization error, so ``actor/kl_loss`` starts at the (small) KL between the
  quantized and the float initial policy, not at 0.

``train.ref_offload = True`` keeps the reference's parameters in host memory (``pinned_host``,
:func:`fp8rl_jax.trainer.offload.move_state`) between uses: moved to the device for the one forward per batch, then
back.

Checkpoints do not store the reference: it is a pure function of the initial weights (``train.model``) and these
two settings, so a resumed run rebuilds it from ``train.model`` when the trainer is constructed (before the restore
replaces the policy's parameters) and gets the same reference log-probs as the uninterrupted run (tested).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fp8rl_jax.trainer.offload import HOST, move_state

#: ``train.ref_precision`` values.
REF_PRECISIONS = ("train", "fp8")


def _copy_state(model):
    """A new module with ``model``'s graph and a copy of every array (the trainer's update donates its buffers)."""
    graphdef, state = nnx.split(model)
    state = jax.tree.map(lambda x: jnp.copy(x) if isinstance(x, jax.Array) else x, state)
    return nnx.merge(graphdef, state)


class ReferencePolicy:
    """The frozen initial policy and its per-batch log-probs.

    Args:
      model: the trainer's policy (:class:`fp8rl_jax.models.decoder.CausalLM`) before any update, configured for
        training (attention / experts / precision set).
      precision: ``"train"`` or ``"fp8"`` (module docstring).
      offload: keep the parameters in ``pinned_host`` memory between uses.
      model_config: the model's :class:`fp8rl_jax.models.config.ModelConfig` (needed for ``"fp8"``).
      mesh: the trainer's mesh, or None; the ``"fp8"`` reference is sharded over it by the project's rules (the
        ``"train"`` copy keeps the policy's shardings).
      expert_impl: MoE expert implementation of the ``"fp8"`` reference (``train.expert_impl``).

    Raises:
      ValueError: unknown ``precision`` (names ``train.ref_precision``); no ``pinned_host`` memory for ``offload``.
    """

    def __init__(self, model, *, precision: str = "train", offload: bool = False, model_config=None, mesh=None,
                 expert_impl: str = "auto"):
        if precision not in REF_PRECISIONS:
            raise ValueError(f"train.ref_precision={precision!r} is not one of {list(REF_PRECISIONS)}")
        self.precision, self.offload, self.mesh = precision, bool(offload), mesh
        if precision == "train":
            self.model = _copy_state(model)
        else:
            self.model = _fp8_copy(model, model_config, mesh, expert_impl)
        self.bytes = sum(int(x.nbytes) for x in jax.tree.leaves(nnx.state(self.model, nnx.Param))
                         if isinstance(x, jax.Array))
        if self.offload:
            move_state(self.model, HOST, what="reference policy's parameters")
        #: seconds the last :meth:`logprobs` spent moving the parameters to the device and back
        self.last_move_s = 0.0

    def logprobs(self, logprobs_fn, prompt_ids, prompt_mask, response_ids, temperature, routed_experts=None):
        """The reference's log-probs of ``response_ids``, float32 ``[B, T]`` (one forward, no gradient).

        Args:
          logprobs_fn: ``(model, prompt_ids, prompt_mask, response_ids, temperature, routed_experts) -> [B, T]``,
            the trainer's jitted log-prob forward (the one that computes ``old_logprobs``).
          prompt_ids, prompt_mask, response_ids, temperature, routed_experts: as for ``old_logprobs``
            (:func:`fp8rl_jax.trainer.logprobs.response_logprobs`).
        """
        t0 = time.perf_counter()
        if self.offload:
            move_state(self.model, "device", what="reference policy's parameters")
        moved = time.perf_counter() - t0
        lp = jax.lax.stop_gradient(logprobs_fn(self.model, prompt_ids, prompt_mask, response_ids, temperature,
                                               routed_experts))
        if self.offload:
            jax.block_until_ready(lp)
            t0 = time.perf_counter()
            move_state(self.model, HOST, what="reference policy's parameters")
            moved += time.perf_counter() - t0
        self.last_move_s = moved
        if self.mesh is None and getattr(lp, "_committed", False):
            # one device: parameters moved back by device_put are committed, and so is this output; a committed
            # array in the train step's batch would make its outputs (the policy's parameters) committed too and
            # every program that takes them (train step, export, rollout) compile again. The trainer's arrays are
            # uncommitted, so this one is made uncommitted too ([B, T] floats through the host).
            lp = jnp.asarray(np.asarray(lp))
        return lp

    def __repr__(self) -> str:
        where = "pinned_host between uses" if self.offload else "device"
        return f"ReferencePolicy({self.precision}, {self.bytes / 2**20:.1f} MiB of parameters, {where})"


def _fp8_copy(model, model_config, mesh, expert_impl: str):
    """A ``CausalLM`` with FP8 W8A8 linears holding ``model``'s current weights, as the FP8 rollout engine would."""
    from fp8rl_jax.export import ModelParamsReader, export_weights
    from fp8rl_jax.models.loading import build_model
    from fp8rl_jax.models.moe import set_expert_impl

    if model_config is None:
        raise ValueError("train.ref_precision='fp8' needs the model's config")
    w = export_weights(ModelParamsReader(model)(), "fp8_blockwise", version=0)
    ref = build_model(model_config, dict(w.tensors), linear_precision="fp8", param_dtype="bfloat16",
                      dtype="bfloat16")
    del w
    if mesh is not None:
        from fp8rl_jax.parallel.loading import shard_model

        shard_model(ref, mesh)
    set_expert_impl(ref, expert_impl)
    # the trainer's attention choice (configure_train_model: cuDNN/XLA, the mesh's q/k/v sharding) for its forward
    attn = next((m for _, m in nnx.iter_graph(model) if hasattr(m, "attention_implementation")), None)
    if attn is not None:
        for _, m in nnx.iter_graph(ref):
            if hasattr(m, "attention_implementation"):
                m.attention_implementation = attn.attention_implementation
                m.qkv_sharding = getattr(attn, "qkv_sharding", None)
    return ref
