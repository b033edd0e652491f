"""The RL run's configuration: one frozen dataclass, gin-configurable under the name ``train``.

Every knob a user turns is a field with a default; gin binds them as ``train.num_steps = 3`` (or
``--gin_param='train.num_steps=3'``); notebooks build ``TrainConfig(...)`` directly.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import gin

from fp8rl_jax.data.math_eval import EVAL_SETS
from fp8rl_jax.data.registry import TRAIN_TASKS
from fp8rl_jax.fp8.training import GRAD_PRECISIONS
from fp8rl_jax.rollout.verify import MISMATCH_ACTIONS, VERIFY_SYNC_MODES
from fp8rl_jax.trainer.dapo import FILTER_METRICS
from fp8rl_jax.trainer.pipeline import check_staleness
from fp8rl_jax.trainer.precision import TRAIN_PRECISIONS
from fp8rl_jax.trainer.validation import check_field_types

ROLLOUT_PRECISIONS = ("fp8", "bf16", "float32")
TRAIN_DTYPES = ("float32",)
ADVANTAGE_ESTIMATORS = ("grpo", "drgrpo", "rloo")


@gin.configurable("train")
@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """GRPO with (FP8) rollout and rollout correction.

    Attributes:
      output_dir: run directory (``metrics.jsonl``, ``summary.json``, ``config.gin``).
      model: packaged model name (``"smollm2-135m-instruct"``), a ``.gguf`` path or an HF directory.
      task: training prompts, one of ``TRAIN_TASKS`` (:func:`fp8rl_jax.data.make_train_dataset`): ``"chain_sum"`` /
        ``"basic_arithmetic"`` (reasoning-gym, gin ``chain_sum_dataset.*``), ``"math"`` (MATH train proxy, 4,500
        problems) or ``"file"`` (a verl-layout parquet/jsonl, gin ``prompt_file_dataset.path``).
      reward: reward function name (:func:`fp8rl_jax.data.get_reward_fn`).
      reward_fn: a user reward function ``(completion: str, item: PromptItem) -> float``, replacing ``reward``: a gin
        reference (``train.reward_fn = @my_module.my_reward``, the function registered with ``@gin.register``) or an
        import path (``"my_module.my_reward"``); None = ``reward``. Runs in a worker process with
        ``reward_timeout_s`` per completion; a failure or timeout scores 0.0 and counts in ``reward/failures``
        (``reward/timeouts``) (:mod:`fp8rl_jax.data.custom_reward`).
      reward_timeout_s: seconds per completion for ``reward_fn`` (> 0); None runs it in the producer's thread with no
        timeout (a failure still scores 0.0 and counts).
      num_steps: RL steps (one rollout + one policy update + one weight sync each).
      prompts_per_step: prompts per step (B); ``samples_per_prompt`` completions each (n, the GRPO group).
      max_tokens: response budget; ``temperature``/``top_p``/``top_k``: sampling (vLLM semantics).
      rollout_precision: ``"fp8"`` (W8A8 blockwise), ``"bf16"`` or ``"float32"`` rollout weights.
      train_dtype: trainer master-param dtype (float32; optax updates these).
      train_precision: forward/backward precision of the trainer: ``"float32"``, ``"bf16"`` (bfloat16 compute),
        ``"fp16"`` (float16 compute, dynamic loss scaling with overflow-skip) or ``"fp8"`` (W8A8 blockwise e4m3
        forward of every decoder linear with a bf16 backward, custom VJP); see :mod:`fp8rl_jax.trainer.precision`.
      fp8_train_grad: backward precision of the FP8 linears (``"bf16"``, ``"e5m2"``, ``"e4m3"`` (DeepSeek-V3: all
        three GEMMs e4m3 with fine-grained scales; on CUDA the Mosaic GPU wgmma GEMM), ``"float32"``).
      loss_scale_init, loss_scale_growth_interval: fp16 dynamic loss scale: initial scale, finite steps per
        doubling (halved on every overflow, which skips the step).
      checkpoint_every: save an orbax checkpoint every N steps (and after the last step); 0 = never.
      keep_checkpoints: keep the last k checkpoints (orbax ``max_to_keep``).
      async_checkpoint: write checkpoints in the background while training goes on (orbax async).
      resume: ``True`` (``--resume``): continue from the latest checkpoint in ``output_dir``, which must exist;
        ``"auto"`` (``--resume=auto``): continue when there is one, else start fresh; ``False``: a new run, and
        ``output_dir`` must hold no earlier run's metrics or checkpoints (checked before any work).
      overwrite: (``--overwrite``) delete an earlier run's metrics, checkpoints, events and plots in
        ``output_dir`` and start fresh.
      plots: write PNG plots of the run's metrics at the end.
      learning_rate, weight_decay, adam_b1, adam_b2, adam_eps, warmup_steps, max_grad_norm: optax AdamW with
        linear warmup and global-norm clipping.
      ppo_epochs, num_minibatches: updates per step (1 and 1 = one on-policy update, verl's default shape).
      advantage_estimator: ``"grpo"`` | ``"drgrpo"`` | ``"rloo"``.
      seed: seeds data order, sampling and init.
      progress_bar: show a tqdm bar.
      max_response_length: verl's ``data.max_response_length``, an alias of ``max_tokens`` (the response budget
        in tokens, also ``L_max`` of the overlong penalty); None = ``max_tokens``. Setting both to different
        values is a ValueError. Read the effective budget from :attr:`response_budget`.
      filter_groups: DAPO dynamic sampling (verl ``algorithm.filter_groups.enable``): drop groups whose
        ``filter_groups_metric`` is equal across the group, generate more prompt batches until
        ``prompts_per_step`` groups are kept (:mod:`fp8rl_jax.trainer.dapo`).
      filter_groups_metric: ``"acc"`` | ``"score"`` (reward before the overlong penalty) | ``"seq_reward"`` |
        ``"seq_final_reward"`` (after it); verl ``filter_groups.metric``.
      max_num_gen_batches: give up (ValueError, as verl) after this many generation batches in one step;
        0 = no limit (verl ``filter_groups.max_num_gen_batches``).
      overlong_buffer_len: DAPO soft overlong punishment buffer ``L_b`` in tokens (verl
        ``reward_model.overlong_buffer.len``); 0 disables. ``overlong_penalty_factor``: penalty at the budget
        (verl ``overlong_buffer.penalty_factor``).
      overlong_filter: DAPO overlong filtering: truncated responses get no loss (response_mask zeroed).
      eval_every: evaluate every N steps and at step 0 (``val/<dataset>/...`` lines in ``metrics.jsonl``;
        verl ``trainer.test_freq``); 0 = never. ``eval_dataset``: ``"gsm8k"`` | ``"math500"``;
        ``eval_num_examples``: first N problems; ``eval_n``: samples per problem; ``eval_temperature``: 0 =
        greedy; ``eval_max_tokens``: response budget (None = the training budget); ``eval_batch_size``:
        prompts per generate call (:func:`fp8rl_jax.trainer.evaluation.evaluate`).
      kv_cache_dtype: rollout KV cache ``"auto"`` (model dtype) or ``"fp8_e4m3"`` (per-layer ``k_scale``/``v_scale``
        recalibrated every step from the training forward and synced with the weights; docs/KV_CACHE.md).
      kv_cache_memory_bytes: rollout KV-cache budget in bytes (vLLM's name); None = unbounded.
      fp8_attention: also quantize queries with ``q_scale`` (FP8 attention; needs ``fp8_e4m3``).
      rollout_engine: ``"jax"`` (the embedded engine) or ``"vllm"`` (real vLLM via
        :func:`rollout_bridge.make_engine`, lazily imported; needs the ``[vllm]`` extra); ``vllm_transport``:
        its weight-sync transport ``"inprocess"`` | ``"shm"`` | ``"dist"`` | ``"vllm"`` (vLLM's own weight-transfer
        API: NCCL on CUDA, gloo on CPU) (docs/ROLLOUT_BRIDGE.md).
      verify_sync: content check of each weight sync (:mod:`fp8rl_jax.rollout.verify`): the engine scores a fixed
        probe and the trainer compares with its own logprobs (and, with an FP8 KV cache, reads back the k/v
        scales); a mismatch raises ``StaleWeightsError`` naming the likely tensor group before the step is logged
        or checkpointed. ``"every_step"`` (default), ``"first"`` (the initial sync only) or ``"off"``.
      mismatch_action: what a batch whose ``rollout_corr/k3_kl`` exceeds the bound for the rollout precision
        (:func:`fp8rl_jax.rollout.verify.mismatch_bound`, or ``max_k3_kl``) does: ``"warn"`` (a loud warning naming
        the likely causes), ``"raise"`` (stop with RuntimeError) or ``"off"``. ``max_k3_kl``: that bound (None =
        by precision).
      max_prompt_length: longest prompt in tokens (verl ``data.max_prompt_length``); with
        ``rollout_engine="vllm"`` it and the response budget size vLLM's ``max_model_len`` and, when
        ``kv_cache_memory_bytes`` is None, its KV-cache budget (every sequence of a step at full length).
      kv_scale_calibration: ``"amax"`` (max of |q|,|k|,|v| over the step's real tokens) or ``"percentile"``
        (NeMo-RL: ``kv_scale_percentile`` of per-sequence maxima); ``kv_scale_margin``: multiplier (None = 1.0 for
        amax, 1.05 for percentile); ``scale = stat * margin / 448``.
      routing_replay: rollout routing replay (R3, arXiv 2510.11370 Sec. 3) for MoE models: the trainer's forwards
        run, at every prompt and response token the engine recorded, the experts the rollout engine chose
        (``RolloutBatch.routed_experts`` / ``prompt_routed_experts``), with gate weights recomputed by the
        trainer's router over that set (so the router still learns); positions without a record are routed
        normally. Changes nothing for a dense model. With an MoE model and an engine that returns no routing
        the first step raises RuntimeError. ``rollout_corr/routing_mismatch`` is logged for MoE models either way.
      mesh: the trainer's device mesh (:mod:`fp8rl_jax.parallel`): ``"fsdp=4,tensor=2"``, a dict
        ``{"fsdp": 8}``, a :class:`fp8rl_jax.parallel.MeshConfig` or a ``jax.sharding.Mesh``; None (default) = the
        gin-bound ``mesh.shape`` (``MeshConfig``), whose default None means one device (the CPU quickstart's path,
        unchanged). Parameters are sharded at load by the rules of :mod:`fp8rl_jax.parallel.rules`, the optimizer
        state like its parameters, the batch over ``data``/``fsdp``/``expert``; the update donates its buffers.
        In one process the embedded engine runs on the same mesh (colocated: the FP8 export, sharded by the same
        rules, becomes its weights without a gather or a second copy); an engine in other processes (vLLM, Ray,
        several JAX processes) gets whole tensors.
      max_staleness: asynchronous RL (:mod:`fp8rl_jax.trainer.pipeline`, docs/ASYNC.md): the rollout of steps
        ``t+1 .. t+k`` runs in a background producer while step ``t`` trains, and no trained token is more than
        ``k`` weight versions older than the trainer. ``0`` (default) is the synchronous loop. Every token carries
        the version that sampled it (``async/staleness_*`` metrics); the loss sees the engine's behaviour
        ``rollout_logprobs`` and the trainer's recomputed ``old_logprobs`` (the ``decoupled_*`` presets: AReaL's
        decoupled PPO).
      async_schedule: ``"fixed"``: batch ``s`` is sampled by exactly version ``max(0, s - k)`` (deterministic,
        resumes bit for bit; ``k = 1`` is verl's one-step-off-policy); ``"latest"``: by the newest published version
        (fully asynchronous, timing-dependent).
      partial_rollout: with ``"latest"``: generate in chunks of ``partial_rollout_tokens`` and apply a newer
        version between chunks, so a sequence cut by an update continues under the new weights (verl / slime
        partial rollouts); its tokens record both versions.
      mismatch_split: with ``max_staleness > 0``: keep the trainer's params of the versions in flight (one extra
        copy of the params per version, up to ``k``) and split ``rollout_corr/k3_kl`` into ``async/k3_precision``
        (trainer vs engine at the sampling version) and ``async/k3_policy_lag`` (trainer now vs then).
      min_kept_fraction, min_kept_fraction_steps: warn once (naming these bindings) when the rollout correction keeps
        less than ``min_kept_fraction`` of the response tokens (``rollout_corr/kept_token_fraction``, logged every
        step) for ``min_kept_fraction_steps`` consecutive steps: a correction that drops everything trains on
        nothing (:mod:`fp8rl_jax.trainer.correction_watch`). ``min_kept_fraction = 0`` turns the warning off.
      micro_batch_size: gradient accumulation: rows per forward/backward inside one optimizer update (maxtext
        ``gradient_accumulation_steps``, tunix ``train_micro_batch_size``); must divide the minibatch
        (``prompts_per_step * samples_per_prompt / num_minibatches``). The loss is normalized by the whole
        minibatch's token (or sequence) count, so the update equals the un-accumulated one
        (:mod:`fp8rl_jax.trainer.train_step`); settings it cannot make exact (``rollout_is_batch_normalize``, custom
        transforms) are refused when the trainer is built. None (default) = the whole minibatch at once.
      remat_policy: activation checkpointing of each decoder layer in the training forward
        (:mod:`fp8rl_jax.models.remat`: ``"none"``, ``"full"``, ``"dots_saveable"``,
        ``"dots_with_no_batch_dims_saveable"``, ``"save_qkv_proj"``, ``"save_out_proj"``; maxtext names). Changes
        memory and compute, never results.
      scan_layers: run identical decoder layers as one ``lax.scan`` in the training forward (one compiled layer;
        maxtext ``scan_layers``); with a remat policy this is what bounds activation memory to one layer's.
      attention_implementation: the training forward's attention (:mod:`fp8rl_jax.models.attention_impl`):
        ``"auto"`` (cuDNN flash attention on a CUDA GPU where cuDNN supports the call, else XLA's, which
        materialises the ``[B, H, S, T]`` scores), ``"xla"`` or ``"cudnn"`` (an error where it cannot run).
      kernels: which GPU kernels programs lowered for CUDA use (:mod:`fp8rl_jax.kernels.registry`): None (default:
        ``$FP8RL_KERNELS``, else ``"auto"``), ``"auto"`` (the project's Pallas kernels and cuDNN attention, each family after a
        one-time self-test on the GPU that falls back to XLA with a warning), ``"xla"`` (XLA everywhere: the escape
        hatch) or ``"pallas"`` (the kernels without the self-test). CPU runs are unaffected.
      autotune: kernel choice by timing on the GPU (:mod:`fp8rl_jax.kernels.tuner`): None (default:
        ``$FP8RL_AUTOTUNE``, else ``"on"``), ``"off"`` (default candidates), ``"cached"`` (stored tables only) or
        ``"on"`` (time untuned keys at first use, within ``$FP8RL_AUTOTUNE_BUDGET_S``). CPU runs are unaffected.
      kv_attention: the embedded engine's decode attention over an FP8 KV cache
        (:data:`fp8rl_jax.kernels.pallas_attention.KV_ATTENTION_IMPLS`: ``"auto"``, ``"materialize"``, ``"pallas"``,
        ``"interpret"``).
      expert_impl: Qwen3-MoE experts in the engine and the trainer (:data:`fp8rl_jax.models.moe.EXPERT_IMPLS`:
        ``"auto"``, ``"pallas"``, ``"mosaic"``, ``"swapab"``, ``"tiled"``, ``"ragged_dot"``;
        :func:`fp8rl_jax.models.moe.set_expert_impl`).
      logprobs_chunk_size: positions per chunk of the logprob/entropy computation (never a ``[B, T, vocab]``
        float32 array; :func:`fp8rl_jax.trainer.logprobs.token_logprobs`); None = all at once.
      ref_precision: the reference policy of the KL loss term (``LossConfig.use_kl_loss``; the initial policy,
        frozen, its log-probs computed once per batch): ``"train"`` (a copy of the initial float32 masters run with
        the trainer's forward) or ``"fp8"`` (the initial weights as the FP8 engine holds them: W8A8 blockwise linears,
        about a quarter of the memory) (:mod:`fp8rl_jax.trainer.reference`). Not checkpointed: rebuilt from
        ``model`` when the trainer is built, so a resumed run has the same reference.
      ref_offload: keep the reference's parameters in host memory (``pinned_host``) between uses.
      offload_optimizer: move the optimizer state to host memory (``pinned_host``) during each rollout and back
        before the update (:mod:`fp8rl_jax.trainer.offload`; tunix-style), freeing 8 bytes/param of accelerator
        memory for the engine. Results are unchanged; each step logs ``timing/offload_s`` and
        ``memory/optimizer_offloaded_gb``.
    """

    output_dir: str = "runs/default"
    model: str = "smollm2-135m-instruct"
    task: str = "chain_sum"
    reward: str = "chain_sum"
    reward_fn: Any = None
    reward_timeout_s: float | None = 10.0
    num_steps: int = 20
    prompts_per_step: int = 8
    samples_per_prompt: int = 4
    max_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    rollout_precision: str = "fp8"
    train_dtype: str = "float32"
    train_precision: str = "float32"
    fp8_train_grad: str = "bf16"
    loss_scale_init: float = 2.0**16
    loss_scale_growth_interval: int = 2000
    checkpoint_every: int = 10
    keep_checkpoints: int = 2
    async_checkpoint: bool = True
    resume: bool | str = False
    overwrite: bool = False
    plots: bool = True
    learning_rate: float = 1e-6
    weight_decay: float = 0.0
    adam_b1: float = 0.9
    adam_b2: float = 0.999
    adam_eps: float = 1e-8
    warmup_steps: int = 0
    max_grad_norm: float = 1.0
    ppo_epochs: int = 1
    num_minibatches: int = 1
    advantage_estimator: str = "grpo"
    seed: int = 0
    progress_bar: bool = True
    max_response_length: int | None = None
    filter_groups: bool = False
    filter_groups_metric: str = "acc"
    max_num_gen_batches: int = 10
    overlong_buffer_len: int = 0
    overlong_penalty_factor: float = 1.0
    overlong_filter: bool = False
    eval_every: int = 0
    eval_dataset: str = "gsm8k"
    eval_num_examples: int = 100
    eval_n: int = 1
    eval_temperature: float = 0.0
    eval_max_tokens: int | None = None
    eval_batch_size: int = 32
    kv_cache_dtype: str = "auto"
    kv_cache_memory_bytes: int | None = None
    fp8_attention: bool = False
    kv_scale_calibration: str = "amax"
    kv_scale_percentile: float = 99.9
    kv_scale_margin: float | None = None
    rollout_engine: str = "jax"
    vllm_transport: str = "inprocess"
    verify_sync: str = "every_step"
    mismatch_action: str = "warn"
    max_k3_kl: float | None = None
    max_prompt_length: int = 512
    routing_replay: bool = False
    mesh: Any = None
    micro_batch_size: int | None = None
    remat_policy: str = "none"
    scan_layers: bool = False
    attention_implementation: str = "auto"
    kernels: str | None = None
    autotune: str | None = None
    kv_attention: str = "auto"
    expert_impl: str = "auto"
    logprobs_chunk_size: int | None = 2048
    offload_optimizer: bool = False
    ref_precision: str = "train"
    ref_offload: bool = False
    max_staleness: int = 0
    async_schedule: str = "fixed"
    partial_rollout: bool = False
    partial_rollout_tokens: int = 32
    mismatch_split: bool = False
    min_kept_fraction: float = 0.05
    min_kept_fraction_steps: int = 3

    @property
    def response_budget(self) -> int:
        """Effective response budget in tokens: ``max_response_length`` if set, else ``max_tokens``."""
        return self.max_tokens if self.max_response_length is None else self.max_response_length

    def _choice(self, name: str, valid) -> None:
        """ValueError unless field ``name`` is one of ``valid`` (names the value and the valid ones)."""
        if getattr(self, name) not in valid:
            raise ValueError(f"train.{name}={getattr(self, name)!r} is not one of {list(valid)}")

    def _int_at_least(self, name: str, lo: int, allow_none: bool = False) -> None:
        """ValueError unless field ``name`` is an int (not a bool) >= ``lo`` (or None with ``allow_none``)."""
        v = getattr(self, name)
        if allow_none and v is None:
            return
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"train.{name} must be an int >= {lo}{' or None' if allow_none else ''}, got {v!r}")

    def __post_init__(self):
        check_field_types(self, "train")  # types first: a str learning rate is named, not a '<=' TypeError later
        if self.resume not in (True, False, "auto"):
            raise ValueError(f"train.resume must be True, False or 'auto', got {self.resume!r}")
        choice = self._choice
        choice("task", TRAIN_TASKS)
        choice("rollout_precision", ROLLOUT_PRECISIONS)
        choice("train_dtype", TRAIN_DTYPES)
        choice("train_precision", TRAIN_PRECISIONS)
        choice("fp8_train_grad", GRAD_PRECISIONS)
        self._int_at_least("checkpoint_every", 0)
        self._int_at_least("keep_checkpoints", 1)
        if not self.loss_scale_init > 0 or int(self.loss_scale_growth_interval) < 1:
            raise ValueError(f"train.loss_scale_init must be > 0 and train.loss_scale_growth_interval >= 1, got "
                             f"{self.loss_scale_init!r}, {self.loss_scale_growth_interval!r}")
        choice("advantage_estimator", ADVANTAGE_ESTIMATORS)
        choice("rollout_engine", ("jax", "vllm"))
        choice("vllm_transport", ("inprocess", "shm", "dist", "vllm"))
        choice("verify_sync", VERIFY_SYNC_MODES)
        choice("mismatch_action", MISMATCH_ACTIONS)
        check_staleness(self.max_staleness, self.async_schedule, self.partial_rollout)
        self._int_at_least("partial_rollout_tokens", 1)
        from fp8rl_jax.trainer.reference import REF_PRECISIONS

        choice("ref_precision", REF_PRECISIONS)
        if self.reward_fn is not None and not (callable(self.reward_fn) or isinstance(self.reward_fn, str)):
            raise ValueError(f"train.reward_fn={self.reward_fn!r} is a {type(self.reward_fn).__name__}; expected a "
                             "function (completion, item) -> float, e.g. @my_module.my_reward, or an import path "
                             "'my_module.my_reward'")
        if self.reward_timeout_s is not None and not self.reward_timeout_s > 0:
            raise ValueError(f"train.reward_timeout_s must be > 0 or None, got {self.reward_timeout_s!r}")
        if not 0 <= self.min_kept_fraction <= 1:
            raise ValueError(f"train.min_kept_fraction must be in [0, 1] (0 = no warning), got "
                             f"{self.min_kept_fraction!r}")
        self._int_at_least("min_kept_fraction_steps", 1)
        if self.max_staleness > 0 and self.offload_optimizer:
            raise ValueError("train.offload_optimizer=True needs train.max_staleness=0: the optimizer state cannot "
                             "wait in host memory during rollout when rollout and training overlap")
        self._int_at_least("max_prompt_length", 1)
        if self.max_k3_kl is not None and not self.max_k3_kl > 0:
            raise ValueError(f"train.max_k3_kl must be > 0 or None, got {self.max_k3_kl!r}")
        for name in ("num_steps", "prompts_per_step", "samples_per_prompt", "max_tokens", "ppo_epochs",
                     "num_minibatches"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be a positive int, got {getattr(self, name)!r}")
        if (self.prompts_per_step * self.samples_per_prompt) % self.num_minibatches:
            raise ValueError(f"prompts_per_step*samples_per_prompt={self.prompts_per_step * self.samples_per_prompt}"
                             f" is not divisible by num_minibatches={self.num_minibatches}")
        self._int_at_least("micro_batch_size", 1, allow_none=True)
        self._int_at_least("logprobs_chunk_size", 1, allow_none=True)
        from fp8rl_jax.models.remat import REMAT_POLICIES

        choice("remat_policy", tuple(REMAT_POLICIES))
        from fp8rl_jax.models.attention_impl import ATTENTION_IMPLS

        choice("attention_implementation", ATTENTION_IMPLS)
        from fp8rl_jax.kernels.registry import MODES
        from fp8rl_jax.kernels.pallas_attention import KV_ATTENTION_IMPLS
        from fp8rl_jax.models.moe import EXPERT_IMPLS

        choice("kernels", (None,) + MODES)
        from fp8rl_jax.kernels.tuner import MODES as AUTOTUNE_MODES

        choice("autotune", (None,) + AUTOTUNE_MODES)
        choice("kv_attention", KV_ATTENTION_IMPLS)
        choice("expert_impl", EXPERT_IMPLS)
        minibatch = self.prompts_per_step * self.samples_per_prompt // self.num_minibatches
        if self.micro_batch_size is not None and minibatch % self.micro_batch_size:
            raise ValueError(f"train.micro_batch_size={self.micro_batch_size} does not divide the minibatch of "
                             f"{minibatch} rows (prompts_per_step*samples_per_prompt/num_minibatches)")
        if self.mesh is not None:
            from fp8rl_jax.parallel.mesh import parse_mesh_shape

            if isinstance(self.mesh, (str, dict)):
                parse_mesh_shape(self.mesh)  # a typo in an axis name fails here, before any work
        if self.learning_rate <= 0:
            raise ValueError(f"train.learning_rate must be > 0, got {self.learning_rate}")
        self._check_dapo_and_eval()

    def start_warnings(self) -> list[str]:
        """Settings that are valid but do nothing, one line each naming the bindings (the trainer warns with them
        when it starts; :class:`fp8rl_jax.trainer.RLTrainer`).

        * ``train.partial_rollout=True`` with ``train.partial_rollout_tokens`` >= the response budget: every row is
          generated in one chunk, so no update ever lands inside a sequence.
        """
        out = []
        if self.partial_rollout and self.partial_rollout_tokens >= self.response_budget:
            out.append(f"train.partial_rollout=True does nothing here: train.partial_rollout_tokens="
                       f"{self.partial_rollout_tokens} >= the response budget {self.response_budget} "
                       "(train.max_tokens / train.max_response_length), so every sequence is generated in one chunk "
                       "and never cut by a weights update; lower train.partial_rollout_tokens below the budget, or "
                       "set train.partial_rollout=False")
        return out

    def _check_dapo_and_eval(self):
        int_at_least = self._int_at_least
        int_at_least("max_response_length", 1, allow_none=True)
        default_max_tokens = type(self).__dataclass_fields__["max_tokens"].default
        if (self.max_response_length is not None and self.max_tokens != default_max_tokens
                and self.max_tokens != self.max_response_length):
            raise ValueError(f"train.max_response_length={self.max_response_length} and train.max_tokens="
                             f"{self.max_tokens} disagree: they name the same response budget, set one")
        self._choice("filter_groups_metric", FILTER_METRICS)
        int_at_least("max_num_gen_batches", 0)
        int_at_least("overlong_buffer_len", 0)
        if self.overlong_buffer_len > self.response_budget:
            raise ValueError(f"train.overlong_buffer_len={self.overlong_buffer_len} exceeds the response budget "
                             f"{self.response_budget} (train.max_tokens / train.max_response_length)")
        if not self.overlong_penalty_factor >= 0:
            raise ValueError(f"train.overlong_penalty_factor must be >= 0, got {self.overlong_penalty_factor!r}")
        int_at_least("eval_every", 0)
        self._choice("eval_dataset", EVAL_SETS)
        int_at_least("eval_num_examples", 1)
        int_at_least("eval_n", 1)
        int_at_least("eval_max_tokens", 1, allow_none=True)
        int_at_least("eval_batch_size", 1)
        if not self.eval_temperature >= 0:
            raise ValueError(f"train.eval_temperature must be >= 0, got {self.eval_temperature!r}")
