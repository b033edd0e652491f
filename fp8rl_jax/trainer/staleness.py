"""The staleness side of a trained batch: :class:`StalenessMixin`, methods of
:class:`~fp8rl_jax.trainer.loop.RLTrainer`.

Before an update the trainer checks every response token's weights version (one it published, at most
``train.max_staleness`` versions old, else the row is dropped) and, in asynchronous mode, splits the mismatch
metrics by lag (``async/k3_kl/lag{j}``) and, with ``train.mismatch_split``, into its precision and policy-lag parts
(``async/k3_precision``, ``async/k3_policy_lag``). Definitions: docs/ASYNC.md; k3 as in
:func:`fp8rl_jax.objectives.rollout_corr_metrics` (Schulman's k3 estimator).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fp8rl_jax import objectives
from fp8rl_jax.trainer.pipeline import RolloutJob, RolloutVersionError, staleness_metrics
from fp8rl_jax.trainer.distributed import to_host


class StalenessMixin:
    """Staleness checks and async mismatch metrics of :class:`~fp8rl_jax.trainer.loop.RLTrainer` (not used on its
    own). Uses the trainer's ``cfg``, ``step_count``, ``model``, ``_logprobs`` and the per-version params it keeps
    for ``train.mismatch_split`` (``_version_params``, ``_shadow_model``)."""

    def _staleness_mask(self, job: RolloutJob, response_mask):
        """Check the batch's token versions against the trainer's (step :attr:`step_count`); drop rows older than
        ``train.max_staleness``. Returns ``(response_mask, metrics)`` (metrics only in asynchronous mode).

        Raises:
          RolloutVersionError: no token versions, or a version the trainer never published.
        """
        cfg, t = self.cfg, self.step_count
        if job.token_versions is None:
            raise RolloutVersionError(f"step {t}: the rollout batch carries no token versions: the trainer cannot "
                                      "name the policy that sampled it")
        tv = np.asarray(job.token_versions)
        live = np.asarray(response_mask) > 0
        unknown = live & ((tv < 0) | (tv > t))
        if unknown.any():
            raise RolloutVersionError(
                f"step {t}: {int(unknown.sum())} response tokens carry weights version(s) "
                f"{sorted(set(tv[unknown].tolist()))[:5]} the trainer never published (it has published 0..{t}): "
                "refusing to train on tokens whose policy it cannot name")
        if cfg.max_staleness == 0:
            return response_mask, {}
        metrics = staleness_metrics(np.where(live, tv, -1), t, cfg.max_staleness)
        dropped = (live & (t - tv > cfg.max_staleness)).any(-1)
        metrics["async/dropped_fraction"] = float(dropped.mean())
        if dropped.any():
            response_mask = np.asarray(response_mask) * (~dropped)[:, None]
        return response_mask, metrics

    def _lag_k3(self, job: RolloutJob, batch: dict) -> dict[str, float]:
        """``async/k3_kl/lag{j}``: ``rollout_corr/k3_kl`` over the tokens sampled ``j`` versions ago."""
        tv = np.asarray(job.token_versions)
        mask = np.asarray(batch["response_mask"]) > 0
        out = {}
        for j in range(self.cfg.max_staleness + 1):
            mj = mask & (tv == self.step_count - j)
            if mj.any():
                m = objectives.rollout_corr_metrics(batch["old_logprobs"], batch["rollout_logprobs"],
                                                    jnp.asarray(mj, jnp.float32))
                out[f"async/k3_kl/lag{j}"] = float(m["rollout_corr/k3_kl"])
        return out

    def _keep_version_params(self, version: int) -> None:
        """``train.mismatch_split``: a copy of the current params, kept while batches of ``version`` may train."""
        self._version_params[int(version)] = jax.tree.map(jnp.copy, nnx.state(self.model, nnx.Param))
        for v in [v for v in self._version_params if v < version - self.cfg.max_staleness]:
            del self._version_params[v]

    def _mismatch_split(self, job: RolloutJob, batch: dict) -> dict[str, float]:
        """``async/k3_precision`` (trainer at each token's sampling version vs the engine's logprobs) and
        ``async/k3_policy_lag`` (trainer now vs at the sampling version), the two parts of the mismatch."""
        cfg = self.cfg
        tv = np.asarray(job.token_versions)
        mask = np.asarray(batch["response_mask"]) > 0
        # to_host: on a multi-process mesh whose token axes span the processes the rows are sharded across them
        now = to_host(self._logprobs(self.model, batch["prompt_ids"], batch["prompt_mask"], batch["response_ids"],
                                     cfg.temperature, batch.get("rollout_routing") if cfg.routing_replay else None))
        then = now.copy()
        if self._shadow_model is None:
            self._shadow_model = nnx.clone(self.model)
        for v in sorted(set(tv[mask].tolist())):
            if v == self.step_count:
                continue
            if v not in self._version_params:  # a batch carried over a resume: its version's params are gone
                return {}
            nnx.update(self._shadow_model, self._version_params[v])
            lp = to_host(self._logprobs(self._shadow_model, batch["prompt_ids"], batch["prompt_mask"],
                                        batch["response_ids"], cfg.temperature,
                                        batch.get("rollout_routing") if cfg.routing_replay else None))
            then = np.where(tv == v, lp, then)
        m = jnp.asarray(mask, jnp.float32)
        prec = objectives.rollout_corr_metrics(jnp.asarray(then), batch["rollout_logprobs"], m)
        lag = objectives.rollout_corr_metrics(jnp.asarray(now), jnp.asarray(then), m)
        return {"async/k3_precision": float(prec["rollout_corr/k3_kl"]),
                "async/k3_policy_lag": float(lag["rollout_corr/k3_kl"])}
