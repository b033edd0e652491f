"""Rematerialisation (activation checkpointing) policies for the decoder layers of the training forward.

A policy decides which intermediate values of a decoder layer the backward pass keeps from the forward pass;
everything else is recomputed from the layer's input (``jax.checkpoint``). Names follow maxtext's
``remat_policy`` (``MaxText/configs/base.yml``; ``layers/decoders.py`` ``get_remat_policy``) and JAX's
``jax.checkpoint_policies``:

* ``"none"``: no ``jax.checkpoint`` at all (every residual of every layer is kept: the fastest, the most memory).
* ``"full"``: ``nothing_saveable``; only each layer's input is kept, the whole layer is recomputed (maxtext
  ``full``; the least memory, about one extra forward of compute).
* ``"dots_saveable"``: keep every matmul output (``jax.checkpoint_policies.dots_saveable``), recompute the
  elementwise work (norms, RoPE, softmax, SwiGLU).
* ``"dots_with_no_batch_dims_saveable"``: keep matmul outputs without batch dimensions, i.e. the projections,
  not the attention score/probability products (maxtext ``minimal`` is this policy).
* ``"save_qkv_proj"``: keep only the q/k/v projection outputs (tagged :data:`QUERY_PROJ`, :data:`KEY_PROJ`,
  :data:`VALUE_PROJ` with ``jax.ad_checkpoint.checkpoint_name``; maxtext ``save_qkv_proj``).
* ``"save_out_proj"``: keep only the attention output projection (:data:`OUT_PROJ`; maxtext ``save_out_proj``).

The policy never affects results, only what is stored versus recomputed; the cached rollout engine path never
uses it (no backward pass).
"""

from __future__ import annotations

from typing import Callable

import jax

# checkpoint_name tags set in :class:`fp8rl_jax.models.decoder.Attention` (maxtext's names).
QUERY_PROJ, KEY_PROJ, VALUE_PROJ, OUT_PROJ = "query_proj", "key_proj", "value_proj", "out_proj"

REMAT_POLICIES = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable", "save_qkv_proj",
                  "save_out_proj")


def validate_remat_policy(name: str) -> str:
    """``name`` itself when it is one of :data:`REMAT_POLICIES`.

    Raises:
      ValueError: any other value, naming it and the valid ones.
    """
    if name not in REMAT_POLICIES:
        raise ValueError(f"remat_policy={name!r} is not supported; expected one of {REMAT_POLICIES}")
    return name


def checkpoint_policy(name: str) -> Callable | None:
    """The ``jax.checkpoint`` ``policy`` callable for a :data:`REMAT_POLICIES` name (``None`` for ``"none"``,
    meaning: do not wrap in ``jax.checkpoint``; ``"full"`` gives ``nothing_saveable``).

    Raises:
      ValueError: an unknown name (see :func:`validate_remat_policy`).

    Source: ``jax.checkpoint_policies`` (JAX docs "Gradient checkpointing with jax.checkpoint").
    """
    cp = jax.checkpoint_policies
    table = {
        "none": None,
        "full": cp.nothing_saveable,
        "dots_saveable": cp.dots_saveable,
        "dots_with_no_batch_dims_saveable": cp.dots_with_no_batch_dims_saveable,
        "save_qkv_proj": cp.save_only_these_names(QUERY_PROJ, KEY_PROJ, VALUE_PROJ),
        "save_out_proj": cp.save_only_these_names(OUT_PROJ),
    }
    return table[validate_remat_policy(name)]
