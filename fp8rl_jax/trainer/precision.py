"""Training precision: ``float32`` | ``bf16`` | ``fp16`` (dynamic loss scaling) | ``fp8`` (blockwise FP8 forward).

One config switch (``train.train_precision``) picks, for the trainer's model,

* the master params: always float32 (optax updates float32 masters, as in mixed-precision training);
* the compute dtype of the forward/backward: float32, bfloat16, float16, or bfloat16 for ``fp8``;
* the product of every decoder-layer linear (``q/k/v/o_proj``, ``gate/up/down_proj``): ``jax.lax``'s for
  float32/bf16/fp16; for ``fp8`` the FP8 training ``dot_general`` of :mod:`fp8rl_jax.fp8.training` (forward W8A8
  blockwise e4m3 — activations 1x128 groups, weights 128x128 blocks — backward in bf16 through a custom VJP),
  the "FP8 end-to-end" setting of the FP8-RL report (arXiv 2601.18150, Experiment 5). Embeddings, norms,
  ``lm_head`` and the MoE router ``mlp.gate`` stay in the compute dtype, as in the rollout export;
* for ``fp16`` only: dynamic loss scaling with overflow-skip, the standard recipe of mixed-precision training
  (Micikevicius et al. 2018, "Mixed Precision Training", Sec. 3.2; the semantics of PyTorch's ``GradScaler``
  and of ``jmp.DynamicLossScale``) that the FP16 RL reports ("Defeating the Training-Inference Mismatch via
  FP16", Qi et al. 2025) use: the loss is multiplied by ``S`` before differentiation, gradients are divided by
  ``S``; a step whose gradients are not finite is skipped (optax's :func:`optax.apply_if_finite` leaves params
  and optimizer state untouched) and halves ``S``; ``growth_interval`` finite steps in a row double ``S``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

TRAIN_PRECISIONS = ("float32", "bf16", "fp16", "fp8")
_COMPUTE_DTYPE = {"float32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp8": "bfloat16"}


def compute_dtype(precision: str) -> str:
    """The forward/backward compute dtype name for a training precision (``"fp8"`` -> ``"bfloat16"``).

    Raises:
      ValueError: unknown precision (names the value and the valid ones).
    """
    if precision not in TRAIN_PRECISIONS:
        raise ValueError(f"train_precision={precision!r} is not one of {list(TRAIN_PRECISIONS)}")
    return _COMPUTE_DTYPE[precision]


def apply_train_precision(model: nnx.Module, precision: str, *, fp8_grad: str = "bf16"):
    """Give every decoder-layer linear of ``model`` the training product for ``precision`` (in place).

    For ``"fp8"`` one FP8 training ``dot_general`` (:func:`fp8rl_jax.fp8.training.make_fp8_train_dot_general`,
    e4m3 blockwise forward, ``fp8_grad`` backward) is built and set as the ``dot_general`` of every
    ``q/k/v/o_proj`` and ``gate/up/down_proj`` :class:`fp8rl_jax.models.decoder.Linear` (Qwen3-MoE experts
    included). Exactly the linears that the FP8 export quantizes get it
    (:func:`fp8rl_jax.export.is_quantized_linear`): ``lm_head`` and the MoE router ``mlp.gate`` are left dense,
    as in the FP8 rollout. Other precisions leave the einsum path (``dot_general = None``).

    Args:
      model: a dense :class:`fp8rl_jax.models.decoder.CausalLM` (float master params).
      precision: one of ``TRAIN_PRECISIONS``.
      fp8_grad: backward precision of the FP8 product (``"bf16"``, ``"e5m2"``, ``"float32"``).

    Returns:
      the ``dot_general`` set (``None`` for non-FP8 precisions).

    Raises:
      ValueError: unknown precision or ``fp8_grad``; a model with FP8 (pre-quantized) linears.
    """
    from fp8rl_jax.export import is_quantized_linear
    from fp8rl_jax.models.decoder import Linear, param_name

    compute_dtype(precision)
    dg = None
    if precision == "fp8":
        from fp8rl_jax.fp8.training import make_fp8_train_dot_general

        dg = make_fp8_train_dot_general(fp8_grad)
    n = 0
    for path, mod in nnx.iter_graph(model):
        # The HF name of the weight, from ``layers`` on (``model.layers.{i}...`` in a CausalLM).
        if (isinstance(mod, Linear) and "layers" in path
                and is_quantized_linear(f"model.{param_name(path[path.index('layers'):])}.weight")):
            if mod.precision != "dense":
                raise ValueError(f"training precision needs dense linears; {'.'.join(map(str, path))} is "
                                 f"{mod.precision!r}")
            mod.dot_general = dg
            n += 1
    if precision == "fp8" and n == 0:
        raise ValueError("train_precision='fp8': the model has no decoder-layer Linear to run in FP8")
    return dg


def wrap_optimizer(tx: optax.GradientTransformation, precision: str,
                   max_consecutive_skips: int = 2**30) -> optax.GradientTransformation:
    """For ``"fp16"``: ``optax.apply_if_finite(tx)`` so a step with inf/NaN gradients changes nothing.

    ``max_consecutive_skips`` is optax's ``max_consecutive_errors`` (after that many skips in a row the update
    is applied anyway); the default never gives up, because the loss scale halves on every skip. Other
    precisions return ``tx`` unchanged.
    """
    compute_dtype(precision)
    return optax.apply_if_finite(tx, max_consecutive_skips) if precision == "fp16" else tx


@dataclasses.dataclass(frozen=True)
class LossScaleConfig:
    """Dynamic loss-scale hyper-parameters (PyTorch ``GradScaler`` defaults).

    Attributes:
      init_scale: initial ``S`` (2**16).
      growth_factor: ``S *= growth_factor`` after ``growth_interval`` finite steps in a row (2.0).
      backoff_factor: ``S *= backoff_factor`` on a non-finite step (0.5).
      growth_interval: finite steps between growths (2000; RL runs take few steps, so configs often use less).
      min_scale: ``S`` never drops below this (1.0).
      max_scale: ``S`` never grows above this (2**24: keeps ``S`` and ``loss * S`` finite in float32).
    """

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float = 1.0
    max_scale: float = 2.0**24

    def __post_init__(self):
        if not (self.init_scale > 0 and self.growth_factor >= 1 and 0 < self.backoff_factor < 1
                and self.growth_interval >= 1 and 0 < self.min_scale <= self.max_scale):
            raise ValueError(f"invalid LossScaleConfig {self}: need init_scale > 0, growth_factor >= 1, "
                             f"0 < backoff_factor < 1, growth_interval >= 1, 0 < min_scale <= max_scale")


class LossScaleState(nnx.Variable):
    """NNX variable type of the dynamic loss-scale state (checkpointed with the optimizer)."""


def init_loss_scale(cfg: LossScaleConfig = LossScaleConfig()) -> dict[str, jax.Array]:
    """Initial state ``{"scale": f32 [], "good_steps": int32 []}``."""
    return {"scale": jnp.asarray(cfg.init_scale, jnp.float32), "good_steps": jnp.zeros((), jnp.int32)}


def all_finite(tree: Any) -> jax.Array:
    """bool ``[]``: every element of every leaf of ``tree`` is finite (no inf, no NaN)."""
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return jnp.asarray(True)
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def unscale(grads: Any, state: dict[str, jax.Array]) -> Any:
    """Gradients of the scaled loss divided by ``S`` (in float32, cast back to each leaf's dtype)."""
    inv = 1.0 / state["scale"]
    return jax.tree.map(lambda g: (g.astype(jnp.float32) * inv).astype(g.dtype), grads)


def adjust_loss_scale(state: dict[str, jax.Array], grads_finite: jax.Array,
                      cfg: LossScaleConfig = LossScaleConfig()) -> dict[str, jax.Array]:
    """Next loss-scale state after a step (jit-safe).

    Non-finite step: ``S <- max(S * backoff_factor, min_scale)``, ``good_steps <- 0``. Finite step:
    ``good_steps += 1``; when it reaches ``growth_interval``: ``S <- min(S * growth_factor, max_scale)`` and
    ``good_steps <- 0`` (``GradScaler.update`` semantics).

    Args:
      state: ``{"scale": f32 [], "good_steps": int32 []}``.
      grads_finite: bool ``[]``.
    """
    scale, good = state["scale"], state["good_steps"]
    good_next = jnp.where(grads_finite, good + 1, 0)
    grow = good_next >= cfg.growth_interval
    new_scale = jnp.where(grads_finite,
                          jnp.where(grow, jnp.minimum(scale * cfg.growth_factor, cfg.max_scale), scale),
                          jnp.maximum(scale * cfg.backoff_factor, cfg.min_scale))
    return {"scale": new_scale.astype(jnp.float32), "good_steps": jnp.where(grow, 0, good_next).astype(jnp.int32)}
