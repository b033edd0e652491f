"""The policy-update step: loss, gradients (optionally accumulated over micro-batches), optimizer update; and its
compiled form with donated buffers, on one device or on a mesh.

Gradient accumulation (``train.micro_batch_size``; maxtext ``gradient_accumulation_steps``, tunix
``train_micro_batch_size``). The minibatch of ``R`` rows is split into ``K = R / micro_batch_size`` micro-batches
(row ``r`` goes to micro-batch ``r % K``, so each micro-batch keeps the rows' split over the batch mesh axes and no
data moves between devices); a ``jax.lax.scan`` runs forward + backward one micro-batch at a time and sums the
gradients, so only one micro-batch's activations are alive at once. The result is the gradient of the *whole
minibatch's* loss, not a mean of per-micro-batch losses: every ``loss_agg_mode`` of
:func:`fp8rl_jax.objectives.policy_loss.agg_loss` is ``sum_k w_k * loss_k / Z`` with

* ``token-mean``: ``w_k`` = tokens of micro-batch ``k`` in the aggregation mask, ``Z`` = tokens of the minibatch
  (the global token count);
* ``seq-mean-token-sum`` / ``seq-mean-token-mean``: ``w_k`` = non-empty rows of ``k``, ``Z`` = non-empty rows of
  the minibatch;
* ``seq-mean-token-sum-norm``: ``w_k = 1``, ``Z = 1`` (a constant normalizer ``T`` or ``loss_scale_factor``).

The KL-to-reference and entropy terms of the loss (``LossConfig.use_kl_loss`` / ``entropy_coeff``) are aggregated
with the same mode over the same mask as the policy loss, so ``loss_k`` (all terms of micro-batch ``k``) decomposes
the same way. The aggregation mask is the rollout-correction mask (rejection sampling removes tokens from the denominator, as
in :func:`fp8rl_jax.objectives.compute_policy_loss`), recomputed here from the same transform. ``w_k`` and ``Z``
carry no gradient (masks are stop-gradient), so ``grad = sum_k grad(w_k * loss_k) / Z`` exactly. This requires the
correction weights of a row to depend on that row only: ``rollout_is_batch_normalize`` (weights divided by the
minibatch mean) and custom transforms not known to be row-local are refused with a ValueError. The reported loss
and all metrics (``actor/*``, ``rollout_corr/*``, routing mismatch) are computed once on the whole minibatch from
the concatenated micro-batch logprobs, so they are the ones of the un-accumulated step.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from fp8rl_jax import objectives
from fp8rl_jax.fp8.kv_cache import masked_row_absmax
from fp8rl_jax.models.decoder import qkv_absmax_from_intermediates
from fp8rl_jax.objectives.metrics import routing_mismatch
from fp8rl_jax.trainer.logprobs import response_logprobs_and_routing
from fp8rl_jax.trainer.precision import adjust_loss_scale, all_finite, unscale


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """Static settings of the train step (hashable: part of the compilation key).

    Attributes:
      loss_config: :class:`fp8rl_jax.objectives.LossConfig`.
      temperature: sampling temperature the logprobs are computed at.
      micro_batch_size: rows per micro-batch (None = the whole minibatch at once).
      capture_qkv: also return per-row max |q|,|k|,|v| (FP8 KV-cache calibration), float32 ``[L, 3, rows]``.
      num_layers: decoder layers (for ``capture_qkv``).
      routing_replay: replay ``batch["rollout_routing"]`` in the forward (R3).
      moe_layers: indices of the sparse layers (routing-mismatch metric).
      logprobs_chunk_size: positions per logits chunk (:func:`fp8rl_jax.trainer.logprobs.token_logprobs`).
      loss_scale_config: fp16 dynamic loss scaling (:class:`fp8rl_jax.trainer.precision.LossScaleConfig`) or None.
    """

    loss_config: Any
    temperature: float = 1.0
    micro_batch_size: int | None = None
    capture_qkv: bool = False
    num_layers: int = 0
    routing_replay: bool = False
    moe_layers: tuple = ()
    loss_scale_config: Any = None
    logprobs_chunk_size: int | None = 2048


def _row_local(transform) -> bool:
    """Whether a rollout-correction transform's weights and mask for a row depend on that row only."""
    from fp8rl_jax.objectives.rollout_correction import Chain, Identity, ImportanceSampling, RejectionSampling, Veto
    from fp8rl_jax.objectives.sequence_masking import OffPolicySequenceMasking, TrustRegionMasking

    if isinstance(transform, Chain):
        return all(_row_local(t) for t in transform.transforms)
    if isinstance(transform, ImportanceSampling):
        return not transform.batch_normalize
    return isinstance(transform, (Identity, RejectionSampling, Veto, OffPolicySequenceMasking, TrustRegionMasking))


def check_micro_batching(loss_config) -> None:
    """Refuse loss settings whose micro-batched gradient would not equal the whole-minibatch gradient.

    Raises:
      ValueError: ``rollout_is_batch_normalize=True`` (weights normalised by the minibatch mean), or a custom
        ``LossConfig.transform`` that is not a chain of the library's row-local transforms.
    """
    rc = loss_config.rollout_correction
    if rc.rollout_is_batch_normalize:
        raise ValueError("train.micro_batch_size cannot be combined with RolloutCorrectionConfig."
                         "rollout_is_batch_normalize=True: the IS weights are normalised by the mean over the whole "
                         "minibatch, which one micro-batch does not see; set micro_batch_size=None (whole minibatch)")
    transform = objectives.correction_transform(loss_config)
    if not _row_local(transform):
        raise ValueError(f"train.micro_batch_size cannot be combined with the custom rollout-correction transform "
                         f"{type(transform).__name__}: micro-batching is exact only for transforms whose weights of a "
                         "row depend on that row alone (ImportanceSampling without batch_normalize, RejectionSampling, "
                         "Veto, OffPolicySequenceMasking, TrustRegionMasking, chains of them)")


def _ref_logprobs(b: dict, loss_config):
    """The batch's reference log-probs when the loss has a KL term (``LossConfig.use_kl_loss``), else None.

    Raises:
      ValueError: ``use_kl_loss`` and the batch has no ``"ref_logprobs"`` (the trainer computes them once per batch:
        :mod:`fp8rl_jax.trainer.reference`).
    """
    if not loss_config.use_kl_loss:
        return None
    if "ref_logprobs" not in b:
        raise ValueError("LossConfig.use_kl_loss=True but the batch has no 'ref_logprobs' (the reference policy's "
                         "log-probs, float32 [R, T]; RLTrainer computes them once per batch)")
    return b["ref_logprobs"]


def _forward_loss(model, b: dict, opts: StepOptions, on_policy: bool):
    """One forward + policy loss on (micro-)batch ``b``: ``(loss, metrics, logprobs, old, router_ids, qkv, entropy)``.

    ``entropy`` (float32 ``[rows, T]``, or None) is computed in the same chunked logits pass as the log-probs when
    the loss needs it (``LossConfig.needs_entropy``), with its gradient when ``entropy_coeff != 0``.
    """
    lc = opts.loss_config
    args = (b["prompt_ids"], b["prompt_mask"], b["response_ids"], opts.temperature,
            b.get("rollout_routing") if opts.routing_replay else None)
    kw = dict(chunk_size=opts.logprobs_chunk_size, return_entropy=lc.needs_entropy,
              entropy_grad=lc.entropy_coeff != 0)
    qkv = None
    if opts.capture_qkv:
        out, inter = nnx.capture(response_logprobs_and_routing, nnx.Intermediate)(model, *args, **kw)
        real = jnp.concatenate([b["prompt_mask"], b["response_mask"] > 0], axis=1)
        qkv = masked_row_absmax(qkv_absmax_from_intermediates(inter, opts.num_layers), real)
    else:
        out = response_logprobs_and_routing(model, *args, **kw)
    lp, router_ids, entropy = out if lc.needs_entropy else (*out, None)
    # on_policy: one update per step, so the policy at the update IS the old policy: old = stop_gradient(lp)
    old = jax.lax.stop_gradient(lp) if on_policy else b["old_logprobs"]
    loss, metrics = objectives.compute_policy_loss(lp, old, b["rollout_logprobs"], b["advantages"],
                                                   b["response_mask"], lc, ref_logprobs=_ref_logprobs(b, lc),
                                                   entropy=entropy)
    return loss, metrics, lp, old, router_ids, qkv, entropy


def _with_routing_metric(metrics, router_ids, b, opts):
    """Add ``rollout_corr/routing_mismatch`` (MoE with a rollout routing record)."""
    if router_ids is None or "rollout_routing" not in b:
        return metrics
    p = b["prompt_ids"].shape[1]
    metrics = dict(metrics)
    metrics["rollout_corr/routing_mismatch"] = routing_mismatch(router_ids[:, p:], b["rollout_routing"][:, p:],
                                                                b["response_mask"], opts.moe_layers)
    return metrics


def _aggregation_weight(lp, old, b, loss_config):
    """``(w_k, z_k)`` of a micro-batch for its loss mode (module docstring); float32 scalars, no gradient."""
    from fp8rl_jax.objectives._common import as_mask
    from fp8rl_jax.objectives.rollout_correction import apply_transform

    rc = loss_config.rollout_correction
    mode = loss_config.loss_agg_mode
    if mode == "seq-mean-token-sum-norm":
        one = jnp.ones((), jnp.float32)
        return one, jnp.zeros((), jnp.float32)
    transform = objectives.correction_transform(loss_config)
    m = as_mask(b["response_mask"])
    target = jax.lax.stop_gradient(lp) if rc.bypass_mode else old  # as compute_policy_loss
    corr_m = apply_transform(transform, target, b["rollout_logprobs"], m, b["advantages"]).mask
    corr_m = jax.lax.stop_gradient(corr_m)
    if mode == "token-mean":
        w = jnp.sum(corr_m)
    else:  # seq-mean-token-sum / seq-mean-token-mean: rows with at least one token in the mask
        w = jnp.sum((jnp.sum(corr_m, axis=-1) > 0).astype(jnp.float32))
    return w, w


def loss_and_grads(model, batch: dict, opts: StepOptions, on_policy: bool, loss_scale=None):
    """Policy loss and its gradient w.r.t. the model's ``nnx.Param`` s (micro-batched when configured).

    Args:
      model: the policy (:class:`fp8rl_jax.models.decoder.CausalLM`).
      batch: ``prompt_ids`` int32 ``[R, P]``, ``prompt_mask`` bool ``[R, P]``, ``response_ids`` int32 ``[R, T]``,
        ``response_mask`` ``[R, T]``, ``rollout_logprobs`` float32 ``[R, T]``, ``advantages`` float32 ``[R]``;
        optional ``old_logprobs`` ``[R, T]`` (needed unless ``on_policy``), ``ref_logprobs`` float32 ``[R, T]``
        (needed with ``LossConfig.use_kl_loss``) and ``rollout_routing`` int32 ``[R, P + T, L, k]``.
      opts: :class:`StepOptions`.
      on_policy: ``old_logprobs := stop_gradient(logprobs)`` (one update per step).
      loss_scale: fp16 loss scale (scalar) the loss is multiplied by before differentiation, or None.

    Returns:
      ``(grads, loss, metrics, old_logprobs, qkv)``: ``grads`` an ``nnx.State`` like ``nnx.state(model, nnx.Param)``
      (scaled by ``loss_scale`` when given), ``loss`` float32 scalar (unscaled), ``metrics`` dict of float32
      scalars, ``old_logprobs`` float32 ``[R, T]``, ``qkv`` float32 ``[L, 3, R]`` or None.

    Raises:
      ValueError: ``R`` not divisible by ``micro_batch_size``; loss settings that micro-batching cannot make exact
        (:func:`check_micro_batching`).
    """
    rows = batch["response_ids"].shape[0]
    mbs = opts.micro_batch_size
    scale = 1.0 if loss_scale is None else loss_scale
    if mbs is None or mbs >= rows:
        def loss_fn(model):
            loss, metrics, _, old, router_ids, qkv, _ = _forward_loss(model, batch, opts, on_policy)
            metrics = _with_routing_metric(metrics, router_ids, batch, opts)
            return loss * scale, (metrics, old, loss, qkv)

        (_, (metrics, old, loss, qkv)), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        return grads, loss, metrics, old, qkv

    if rows % mbs:
        raise ValueError(f"train.micro_batch_size={mbs} does not divide the minibatch of {rows} rows")
    check_micro_batching(opts.loss_config)
    k = rows // mbs
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def to_micro(x):  # [R, ...] -> [K, mbs, ...], micro-batch j = rows j, j + K, j + 2K, ...
        return jnp.swapaxes(x.reshape((mbs, k) + x.shape[1:]), 0, 1)

    def from_micro(x):  # [K, mbs, ...] -> [R, ...] in the original row order
        return jnp.swapaxes(x, 0, 1).reshape((rows,) + x.shape[2:])

    micro = jax.tree.map(to_micro, batch)

    def body(carry, mb):
        gacc, z = carry

        def f(p):
            m = nnx.merge(graphdef, p, rest)
            loss_k, _, lp, old, router_ids, qkv, ent = _forward_loss(m, mb, opts, on_policy)
            w, zk = _aggregation_weight(lp, old, mb, opts.loss_config)
            ent = None if ent is None else jax.lax.stop_gradient(ent)
            return loss_k * w * scale, (jax.lax.stop_gradient(lp), old, router_ids, qkv, zk, ent)

        g, (lp, old, router_ids, qkv, zk, ent) = jax.grad(f, has_aux=True)(params)
        gacc = jax.tree.map(jnp.add, gacc, g)
        return (gacc, z + zk), (lp, old, router_ids, qkv, ent)

    zeros = jax.tree.map(jnp.zeros_like, params)
    (gacc, z), (lp, old, router_ids, qkv, ent) = jax.lax.scan(body, (zeros, jnp.zeros((), jnp.float32)), micro)
    if opts.loss_config.loss_agg_mode == "seq-mean-token-sum-norm":
        grads = gacc
    else:
        denom = jnp.where(z > 0, z, 1.0)
        grads = jax.tree.map(lambda g: g / denom, gacc)
    lp, old = from_micro(lp), from_micro(old)
    ent = from_micro(ent) if ent is not None else None
    router_ids = from_micro(router_ids) if router_ids is not None else None
    if qkv is not None:  # [K, L, 3, mbs] -> [L, 3, R]
        qkv = jnp.transpose(qkv, (1, 2, 3, 0)).reshape(qkv.shape[1], qkv.shape[2], rows)
    # loss value and metrics of the whole minibatch (exactly the un-accumulated step's)
    loss, metrics = objectives.compute_policy_loss(lp, old, batch["rollout_logprobs"], batch["advantages"],
                                                   batch["response_mask"], opts.loss_config,
                                                   ref_logprobs=_ref_logprobs(batch, opts.loss_config), entropy=ent)
    metrics = _with_routing_metric(metrics, router_ids, batch, opts)
    return grads, loss, metrics, old, qkv


def train_step(model, optimizer, batch: dict, opts: StepOptions, on_policy: bool):
    """One optimizer update on ``batch`` (in place on ``model`` / ``optimizer``; traceable under ``jax.jit``).

    With fp16 loss scaling (``opts.loss_scale_config``) the gradients are unscaled, a non-finite update is skipped
    (``optax.apply_if_finite`` in the optimizer) and the scale adjusted (``optimizer.loss_scale``).

    Returns:
      ``(metrics, old_logprobs, qkv)``: metrics (float32 scalars: the loss's ``actor/*`` and ``rollout_corr/*``,
      ``actor/loss``, ``actor/grad_norm``, and for fp16 ``actor/loss_scale`` / ``actor/skipped_step``),
      ``old_logprobs`` float32 ``[R, T]``, ``qkv`` float32 ``[L, 3, R]`` or None.
    """
    ls_cfg = opts.loss_scale_config
    ls = ({"scale": optimizer.loss_scale[...], "good_steps": optimizer.loss_scale_good_steps[...]}
          if ls_cfg is not None else None)
    grads, loss, metrics, old, qkv = loss_and_grads(model, batch, opts, on_policy,
                                                    ls["scale"] if ls is not None else None)
    if ls is not None:  # unscale; optax.apply_if_finite skips a non-finite update; adjust the scale
        grads = unscale(grads, ls)
        finite = all_finite(grads)
        new_ls = adjust_loss_scale(ls, finite, ls_cfg)
        optimizer.loss_scale[...] = new_ls["scale"]
        optimizer.loss_scale_good_steps[...] = new_ls["good_steps"]
    optimizer.update(model, grads)
    metrics = dict(metrics)
    if ls is not None:
        metrics["actor/loss_scale"] = ls["scale"]
        metrics["actor/skipped_step"] = 1.0 - finite.astype(jnp.float32)
    metrics["actor/loss"] = loss
    metrics["actor/grad_norm"] = optax.global_norm(grads)
    return metrics, old, qkv


class CompiledTrainStep:
    """:func:`train_step` under ``jax.jit`` with the model's and optimizer's buffers donated, on a mesh or not.

    The model and optimizer are split into their ``nnx.State`` s (``nnx.split``) and passed to a pure jitted
    function whose outputs are written back with ``nnx.update``; the input state buffers are donated
    (``donate_argnums``), so XLA updates parameters and optimizer moments in place instead of holding two copies
    (on CPU too: XLA:CPU honours donation, tested). Do not keep references to the model's or optimizer's arrays
    across a call: they are deleted by it (read them again from the model).

    On a mesh the input shardings are the ones the state already has (set at load by
    :mod:`fp8rl_jax.parallel.rules`), the new state is constrained to the same shardings (so donation can alias
    the buffers), and the batch is placed with :func:`fp8rl_jax.parallel.rules.batch_sharding` (rows over
    ``data``/``fsdp``/``expert``; with micro-batching, split so that every micro-batch keeps that split).

    Args:
      opts: :class:`StepOptions`.
      mesh: a ``jax.sharding.Mesh`` or None (single device).
      donate: donate the model/optimizer buffers (default True).
    """

    def __init__(self, opts: StepOptions, mesh=None, donate: bool = True):
        self.opts, self.mesh, self.donate = opts, mesh, donate
        self._jitted: dict = {}

    def batch_shardings(self, batch: dict) -> dict | None:
        """``{key: NamedSharding}`` for a batch on the mesh (None without a mesh)."""
        if self.mesh is None:
            return None
        from fp8rl_jax.parallel.rules import batch_sharding

        rows = batch["response_ids"].shape[0]
        mbs = self.opts.micro_batch_size
        lead = mbs if (mbs is not None and mbs < rows) else rows  # rows a device split must divide
        out = {}
        for key, x in batch.items():
            dim0 = batch_sharding(self.mesh, (lead,) + tuple(x.shape[1:]))
            out[key] = dim0
        return out

    def _compile(self, gd_model, gd_opt, on_policy: bool, in_sh):
        opts = self.opts

        def step(model_state, opt_state, batch):
            model = nnx.merge(gd_model, model_state)
            optimizer = nnx.merge(gd_opt, opt_state)
            metrics, old, qkv = train_step(model, optimizer, batch, opts, on_policy)
            new_m, new_o = nnx.state(model), nnx.state(optimizer)
            if in_sh is not None:
                new_m = jax.lax.with_sharding_constraint(new_m, in_sh[0])
                new_o = jax.lax.with_sharding_constraint(new_o, in_sh[1])
            return new_m, new_o, metrics, old, qkv

        return jax.jit(step, donate_argnums=(0, 1) if self.donate else (), in_shardings=in_sh)

    def __call__(self, model, optimizer, batch: dict, on_policy: bool):
        """Run one update in place; returns ``(metrics, old_logprobs, qkv)`` (device arrays)."""
        gd_model, model_state = nnx.split(model)
        gd_opt, opt_state = nnx.split(optimizer)
        in_sh = None
        b_sh = self.batch_shardings(batch)
        if b_sh is not None:
            batch = jax.device_put(batch, b_sh)
            sharding_of = lambda x: x.sharding  # noqa: E731
            in_sh = (jax.tree.map(sharding_of, model_state), jax.tree.map(sharding_of, opt_state), b_sh)
        key = (gd_model, gd_opt, bool(on_policy), None if in_sh is None else _sharding_key(in_sh))
        fn = self._jitted.get(key)
        if fn is None:
            fn = self._jitted[key] = self._compile(gd_model, gd_opt, bool(on_policy), in_sh)
        new_m, new_o, metrics, old, qkv = fn(model_state, opt_state, batch)
        nnx.update(model, new_m)
        nnx.update(optimizer, new_o)
        return metrics, old, qkv


def _sharding_key(in_sh) -> tuple:
    """A hashable key of a shardings pytree (its leaves' specs, in order)."""
    leaves, treedef = jax.tree.flatten(in_sh)

    def spec(s):
        parts = list(getattr(s, "spec", ()))
        while parts and parts[-1] is None:  # P('x', None) and P('x') are the same placement
            parts.pop()
        return (str(tuple(parts)), str(getattr(s, "memory_kind", None)), id(getattr(s, "mesh", None)))

    return (str(treedef), tuple(spec(s) for s in leaves))
