"""The embedded JAX rollout engine: batched prefill + decode with a preallocated KV cache.

One jitted program per (batch, prompt bucket, max_tokens, sampling switches) runs the prefill and a
``lax.while_loop`` of decode steps that stops early once every row has hit a stop token. Prompts are
left-padded to a bucket of ``prompt_bucket`` tokens; RoPE positions start at each row's first real token, so a
padded row computes exactly what it would alone.

Weights are bf16/float32 dense or FP8 W8A8 blockwise (``precision``), and are replaced in place by
:meth:`JaxRolloutEngine.update_weights` from the trainer's :class:`ExportedWeights` each step. An FP8 engine runs
q/k/v and a dense MLP's gate/up as vLLM's fused ``qkv_proj`` / ``gate_up_proj`` wherever their 128-row blocks
allow (:mod:`fp8rl_jax.models.fused`; issue 21): one W8A8 product (on CUDA one launch of the split-K decode kernel)
per fused group and decode step, the activation quantized once. It takes the weights fused
(``export_weights(fuse=True)``, what the trainer sends it: installed without a copy) or under the HF names (fused by
one concatenation program on load).

The KV cache is kept in the model dtype (``kv_cache_dtype="auto"``) or in e4m3 (``"fp8_e4m3"``, vLLM semantics:
per-layer scalar ``k_scale``/``v_scale`` dequantization multipliers, optional ``q_scale`` FP8 attention). The
scales arrive with the weights (``model.layers.{i}.self_attn.{k,v,q}_scale``) and are applied in place; an FP8
engine refuses to generate while its scales are older than its weights. With ``kv_cache_memory_bytes`` the cache
is budgeted in bytes as in vLLM (pages of 16 tokens): a batch that does not fit runs in chunks of at most the
maximum concurrency, so an e4m3 cache runs twice the sequences of a bf16 one at once.
"""

from __future__ import annotations

import functools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fp8rl_jax.fp8.kv_cache import (DEFAULT_BLOCK_SIZE, KVCacheCapacity, KVScales, is_kv_scale_name,
                                    kv_cache_bytes_per_token, kv_cache_capacity, kv_cache_storage_dtype,
                                    normalize_kv_cache_dtype)
from fp8rl_jax.kernels.pallas_attention import use_fp8_kv_kernel
from fp8rl_jax.models.config import ModelConfig
from fp8rl_jax.models.decoder import Attention, KVCache, left_pad, param_name, positions_from_mask
from fp8rl_jax.models.experts import expert_names, is_expert_stack_name, split_expert_stacks
from fp8rl_jax.models.moe import set_expert_impl, set_expert_parallel
from fp8rl_jax.models.fused import fuse_tensors, split_names, split_tensors
from fp8rl_jax.models.loading import build_model
from fp8rl_jax.rollout.sampling import sample_tokens
from fp8rl_jax.rollout.types import ExportedWeights, RolloutBatch, SamplingParams, check_prompt_token_ids

ENGINE_PRECISIONS = {"fp8": ("fp8", "bfloat16", "fp8_blockwise"), "bf16": ("dense", "bfloat16", "bf16"),
                     "float32": ("dense", "float32", "float32")}


def engine_fuses_projections(precision: str, mesh=None, fuse_projections: bool = True) -> bool:
    """Whether a :class:`JaxRolloutEngine` with these arguments runs fused ``qkv_proj`` / ``gate_up_proj``.

    True for an FP8 engine on one device: the fused rows ``[q; k; v]`` have no head-aligned split over a mesh's
    ``tensor`` axis (vLLM's TP layout interleaves them per rank, :mod:`fp8rl_jax.export_tp`), so an engine on a mesh
    stays unfused, as do the bf16/float32 engines. Which groups fuse then depends on the config
    (:func:`fp8rl_jax.models.fused.fused_projections`). A trainer asks this to export its sync fused.

    Raises:
      ValueError: unknown precision.
    """
    if precision not in ENGINE_PRECISIONS:
        raise ValueError(f"unknown rollout precision {precision!r}; expected one of {sorted(ENGINE_PRECISIONS)}")
    return bool(fuse_projections) and ENGINE_PRECISIONS[precision][0] == "fp8" and mesh is None


def configure_engine_model(model, kv_attention: str | None, expert_impl: str) -> str:
    """Set the engine's kernel choices on a model (the engine and ``scripts/plan.py`` build the same program):
    ``kv_attention`` (:data:`fp8rl_jax.kernels.pallas_attention.KV_ATTENTION_IMPLS`; None leaves the modules' own) on
    every attention module, ``expert_impl`` on every sparse MLP block (:func:`fp8rl_jax.models.moe.set_expert_impl`,
    which raises ``ValueError`` for an unknown name). Returns the expert implementation set."""
    if kv_attention is not None:
        for _, mod in nnx.iter_modules(model):
            if isinstance(mod, Attention):
                mod.kv_attention = kv_attention
    return set_expert_impl(model, expert_impl)


class StaleWeightsError(RuntimeError):
    """Raised when generation is requested with weights older than the engine was told to expect."""


class StaleKVScalesError(StaleWeightsError):
    """Raised when an FP8 KV cache would be used with ``k_scale``/``v_scale`` older than the loaded weights."""


def check_weights_current(weights_version: int, expected_version: int | None, kv_cache_dtype: str,
                          kv_scales_version: int) -> None:
    """The staleness checks every rollout engine runs before generating (embedded JAX engine and vLLM alike).

    Args:
      weights_version: version of the weights the engine holds.
      expected_version: version the trainer expects (None: no check).
      kv_cache_dtype: the engine's KV-cache dtype (any :func:`normalize_kv_cache_dtype` spelling).
      kv_scales_version: weights version the engine's ``k_scale``/``v_scale`` were calibrated for (``-1``: none).

    Raises:
      StaleWeightsError: ``expected_version`` is newer than ``weights_version``.
      StaleKVScalesError: an e4m3 KV cache whose scales are older than the weights (or were never set).
      ValueError: unknown ``kv_cache_dtype`` (from :func:`normalize_kv_cache_dtype`).
    """
    if expected_version is not None and weights_version < expected_version:
        raise StaleWeightsError(f"engine weights are version {weights_version}, trainer expects "
                                f"{expected_version}: call update_weights first")
    if normalize_kv_cache_dtype(kv_cache_dtype) == "fp8_e4m3" and kv_scales_version < weights_version:
        have = "none" if kv_scales_version < 0 else f"version {kv_scales_version}"
        raise StaleKVScalesError(
            f"fp8_e4m3 KV cache: k_scale/v_scale are {have} but the weights are version {weights_version}; "
            "export recalibrated scales with the weights (model.layers.{i}.self_attn.k_scale/v_scale)")


class JaxRolloutEngine:
    """Embedded rollout engine (implements :class:`fp8rl_jax.rollout.types.RolloutEngine`).

    Args:
      config: model architecture.
      weights: initial :class:`ExportedWeights` in this engine's format (see ``precision``).
      precision: ``"fp8"`` (W8A8 blockwise e4m3 linears, bf16 activations), ``"bf16"`` or ``"float32"``.
      pad_token_id: id written after a row ends (defaults to the config's pad, else 0).
      eos_token_ids: ids that end a response unless ``ignore_eos`` (default: the config's EOS ids).
      prompt_bucket: prompts are left-padded to a multiple of this (limits recompilation).
      seed: base PRNG seed for calls without ``SamplingParams.seed``.
      kv_cache_dtype: ``"auto"`` (cache in the model dtype) or ``"fp8_e4m3"`` (vLLM names; ``"fp8"`` accepted).
        An e4m3 cache needs ``model.layers.{i}.self_attn.{k,v}_scale`` tensors in ``weights`` (or
        :meth:`set_kv_scales`) before :meth:`generate`.
      kv_cache_memory_bytes: cache budget in bytes (vLLM's name); ``None`` = unbounded (one pass per batch).
      fp8_attention: also quantize queries with ``q_scale`` and run ``QK^T`` on e4m3 values (needs fp8_e4m3).
      max_model_len: tokens per request for the concurrency report (default: ``max_position_embeddings``).
      kv_block_size: tokens per cache page for the byte budget (vLLM default 16).
      log_kv_cache: print the cache-capacity line at start (as vLLM logs "GPU KV cache size").
      mesh: optional ``jax.sharding.Mesh`` (:mod:`fp8rl_jax.parallel.mesh`) to serve on: weights sharded by the
        rules of :mod:`fp8rl_jax.parallel.rules` (attention heads, MLP and vocab over ``tensor``, ``embed`` over
        ``fsdp``), prompts split over ``data`` when it divides the batch; the KV cache follows the k/v projections
        (sharded by KV head). Greedy decoding equals the one-device engine's token for token (tested, float32).
      fuse_projections: FP8 on one device (:func:`engine_fuses_projections`): run q/k/v and dense gate/up as vLLM's
        fused ``qkv_proj`` / ``gate_up_proj`` where every part's rows are a multiple of 128
        (:attr:`fused_projections` lists them; the others stay separate). Same greedy tokens and logprobs as the
        unfused engine (bit for bit on CPU, tested). ``weights`` may then be fused or under the HF names.
      kv_attention: attention over an e4m3 cache (:data:`fp8rl_jax.kernels.pallas_attention.KV_ATTENTION_IMPLS`):
        ``"auto"`` runs :func:`fp8rl_jax.kernels.pallas_attention.fp8_kv_decode_attention` at decode and
        :func:`~fp8rl_jax.kernels.pallas_attention.fp8_kv_prefill_attention` at prefill (the cache read and dequantized
        inside a Pallas kernel, only up to each row's last slot) where lowered for one CUDA GPU, and the
        materialized path elsewhere (CPU results unchanged; on a mesh too, since the kernels are not
        SPMD-partitioned); ``"materialize"`` always dequantizes the cache and calls ``jax.nn.dot_product_attention``;
        ``"pallas"`` forces the kernels (interpret mode off a GPU), ``"interpret"`` the kernels in interpret mode
        (tests). A bf16 cache always takes the materialized path.
      expert_impl: Qwen3-MoE experts (:class:`fp8rl_jax.models.moe.SparseMoeBlock`, its ``EXPERT_IMPLS``):
        ``"auto"`` (FP8: the grouped kernels where lowered for CUDA, the Mosaic GPU wgmma one for prefill-sized
        tiles and the grouped swap-AB Mosaic GPU one for decode (e4m3; Pallas-Triton for e5m2); otherwise tiles or
        ``ragged_dot``, whichever moves fewer elements), ``"pallas"`` (FP8: always the Pallas-Triton kernel),
        ``"mosaic"`` (FP8: always the Mosaic GPU GEMM), ``"swapab"`` (FP8: always the grouped swap-AB decode
        kernel), ``"tiled"`` or ``"ragged_dot"`` (never a kernel, that XLA path).
      moe_dispatch: on a ``mesh`` with ``expert > 1``: ``"auto"`` / ``"all_to_all"`` (expert parallelism, each
        device runs its ``E / expert`` experts on the rows sent to it, :mod:`fp8rl_jax.models.expert_parallel`) or
        ``"replicated"``; or a dict of :func:`fp8rl_jax.models.moe.set_expert_parallel`'s keywords (``dispatch``,
        ``all_to_all``, ``capacity_factors``, ``chunk_tokens``: :meth:`fp8rl_jax.parallel.moe_dispatch.MoeDispatchConfig.kwargs`).

    Raises:
      ValueError: unknown precision or kv_cache_dtype, ``moe_dispatch`` or an ``expert`` axis that does not divide
        the experts, weights in the wrong format, ``fp8_attention`` without an
        FP8 cache, or malformed kv scales.
    """

    def __init__(self, config: ModelConfig, weights: ExportedWeights, *, precision: str = "fp8",
                 pad_token_id: int | None = None, eos_token_ids: Sequence[int] | None = None,
                 prompt_bucket: int = 16, seed: int = 0, kv_cache_dtype: str = "auto",
                 kv_cache_memory_bytes: int | None = None, fp8_attention: bool = False,
                 max_model_len: int | None = None, kv_block_size: int = DEFAULT_BLOCK_SIZE,
                 log_kv_cache: bool = True, mesh=None, fuse_projections: bool = True, kv_attention: str = "auto",
                 expert_impl: str = "auto", moe_dispatch: str | dict = "auto"):
        if precision not in ENGINE_PRECISIONS:
            raise ValueError(f"unknown rollout precision {precision!r}; expected one of {sorted(ENGINE_PRECISIONS)}")
        self.config, self.precision = config, precision
        linear, dtype, self.weight_format = ENGINE_PRECISIONS[precision]
        self.kv_cache_dtype = normalize_kv_cache_dtype(kv_cache_dtype)
        if fp8_attention and self.kv_cache_dtype != "fp8_e4m3":
            raise ValueError("fp8_attention=True needs kv_cache_dtype='fp8_e4m3' (as in vLLM)")
        self.fp8_attention = bool(fp8_attention)
        use_fp8_kv_kernel(kv_attention)  # validates the name
        self._check_format(weights)
        params = {k: v for k, v in weights.tensors.items() if not is_kv_scale_name(k)}
        self.model = build_model(config, params, linear_precision=linear, param_dtype=dtype, dtype=dtype,
                                 fuse_projections=engine_fuses_projections(precision, mesh, fuse_projections))
        #: attention over an e4m3 cache (see ``kv_attention``) and the Qwen3-MoE expert implementation (see
        #: ``expert_impl``), as set on the model's modules
        self.kv_attention = "materialize" if (kv_attention == "auto" and mesh is not None) else kv_attention
        self.expert_impl = configure_engine_model(self.model, self.kv_attention, expert_impl)
        #: the fused q/k/v and gate/up groups this engine runs (:class:`fp8rl_jax.models.fused.FusedProjection`)
        self.fused_projections = self.model.fused_projections
        self.cache_dtype = kv_cache_storage_dtype(self.kv_cache_dtype, dtype)
        # tensor-parallel serving (issue 19): weights placed on ``mesh`` by the rules of fp8rl_jax.parallel.rules
        # (heads / MLP / vocab over ``tensor``), the batch over ``data``; XLA's sharding propagation places the KV
        # cache (written from the head-sharded k/v projections: sharded by KV head) and the activations
        self.mesh = mesh
        self.sharding_plan = None
        #: whether the MoE layers dispatch their routed rows to the experts' owners (``expert > 1`` on ``mesh``)
        moe_kw = dict(moe_dispatch) if isinstance(moe_dispatch, dict) else {"dispatch": moe_dispatch}
        self.expert_parallel = set_expert_parallel(self.model, mesh, **moe_kw)
        self._place_on_mesh()
        self._names = {param_name(p): v for p, v in nnx.to_flat_state(nnx.state(self.model, nnx.Param))}
        # Qwen3-MoE experts are [E, N, K] stacks (fp8rl_jax.models.experts); updates name them per expert
        self._expert_stacks = {n: tuple(expert_names(n, v[...].shape[0])) for n, v in self._names.items()
                               if is_expert_stack_name(n)}
        per_expert = {p for parts in self._expert_stacks.values() for p in parts}
        self._fused_part_names = set(split_names(self._names, self.fused_projections))
        self._hf_names = (self._fused_part_names - set(self._expert_stacks)) | per_expert
        self.weights_version = weights.version
        self.kv_scales: KVScales | None = None
        self.kv_scales_version = -1
        self._apply_kv_scales(weights)
        self.max_model_len = int(max_model_len or config.max_position_embeddings)
        self.kv_capacity: KVCacheCapacity | None = None
        self.last_num_chunks = 0  # generate() passes the last call needed (byte budget)
        if kv_cache_memory_bytes is not None:
            self.kv_capacity = kv_cache_capacity(
                config.num_hidden_layers, config.num_key_value_heads, config.head_dim, kv_cache_memory_bytes,
                self.kv_cache_dtype, dtype, self.max_model_len, kv_block_size)
        if log_kv_cache:
            print(self.kv_cache_report())
        self.pad_token_id = int(pad_token_id if pad_token_id is not None else (config.pad_token_id or 0))
        self.eos_token_ids = tuple(eos_token_ids if eos_token_ids is not None else config.eos_token_ids)
        self.prompt_bucket = prompt_bucket
        self._key = jax.random.key(seed)
        self.last_sync_s = 0.0
        # R3 (arXiv 2510.11370): an MoE engine records every fed token's top-k experts per layer in generate()
        self.records_routing = self.model.is_moe

    def _place_on_mesh(self) -> None:
        """Shard the weights over :attr:`mesh` (if any), then refresh the split state the programs take."""
        if self.mesh is not None:
            from fp8rl_jax.parallel.loading import shard_model

            self.sharding_plan = shard_model(self.model, self.mesh)
        self.graphdef, self.state = nnx.split(self.model)

    def _batch_input(self, x: np.ndarray) -> jax.Array:
        """A host batch as a device array: split over the mesh's ``data`` axis when it divides the rows."""
        if self.mesh is None or self.mesh.shape.get("data", 1) == 1 or x.shape[0] % self.mesh.shape["data"]:
            return jnp.asarray(x)
        from jax.sharding import NamedSharding, PartitionSpec

        return jax.device_put(x, NamedSharding(self.mesh, PartitionSpec("data")))

    def _check_format(self, weights: ExportedWeights) -> None:
        if weights.format != self.weight_format:
            raise ValueError(f"engine with precision={self.precision!r} needs weights exported as "
                             f"{self.weight_format!r}, got {weights.format!r}")

    def kv_cache_report(self) -> str:
        """The engine-start line: cache dtype, bytes/token, and with a byte budget the tokens that fit and the
        maximum concurrency, beside what a bf16 cache would hold (vLLM's "GPU KV cache size" report)."""
        cfg = self.config
        if self.kv_capacity is None:
            bpt = kv_cache_bytes_per_token(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                                           self.kv_cache_dtype, self.cache_dtype)
            return (f"[fp8rl_jax engine] KV cache {self.kv_cache_dtype} ({jnp.dtype(self.cache_dtype).name}): "
                    f"{bpt} B/token, no kv_cache_memory_bytes budget (one pass per batch)")
        cap = self.kv_capacity
        line = f"[fp8rl_jax engine] {cap.report()}"
        if cap.kv_cache_dtype == "fp8_e4m3":
            ref = kv_cache_capacity(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, cap.memory_bytes,
                                    "auto", "bfloat16", cap.max_model_len, cap.block_size)
            line += f" (a bf16 cache would hold {ref.num_tokens:,} tokens, {ref.max_concurrency:.2f}x)"
        return line

    def _apply_kv_scales(self, weights: ExportedWeights) -> None:
        scales = KVScales.from_tensors(weights.tensors, self.config.num_hidden_layers)
        if scales is not None:
            self.set_kv_scales(scales, weights.metadata.get("kv_scales_version", weights.version))

    def set_kv_scales(self, scales: KVScales, version: int) -> None:
        """Install per-layer ``k_scale``/``v_scale``/``q_scale`` (float32 ``[num_layers]``) in place.

        Args:
          scales: the new scales (vLLM's dequantization multipliers).
          version: the weights version they were calibrated for.

        Raises:
          ValueError: wrong number of layers, or non-positive / non-finite scales (named).
        """
        n = self.config.num_hidden_layers
        arrs = []
        for name in ("k_scale", "v_scale", "q_scale"):
            a = np.asarray(getattr(scales, name), np.float32)
            if a.shape != (n,):
                raise ValueError(f"{name} must have shape ({n},), got {a.shape}")
            if not np.all(np.isfinite(a) & (a > 0)):
                raise ValueError(f"{name} must be finite and > 0, got {a}")
            arrs.append(jnp.asarray(a))
        self.kv_scales = KVScales(*arrs)
        self.kv_scales_version = int(version)

    def update_weights(self, weights: ExportedWeights) -> None:
        """Replace all weights (and, when present, the kv scales) in place (no host round trip).

        With :attr:`fused_projections` the weights may come fused (``export_weights(fuse=True)``: each array is
        installed as it is, no copy) or under the HF names (each group's parts are concatenated by one jitted
        program: a copy of those tensors). A Qwen3-MoE model's experts come per expert under the HF names
        (``model.layers.{i}.mlp.experts.{j}.gate_proj.weight`` + ``_scale_inv``, what every export names them) and
        are restacked into the engine's ``[E, N, K]`` stacks by one jitted program whose outputs keep the stacks'
        shardings (or come already stacked under the stacked names, installed as they are).

        Raises:
          ValueError: wrong format, missing/unexpected names, a shape/dtype mismatch, or malformed kv scales
            (named).
        """
        t0 = time.perf_counter()
        self._check_format(weights)
        tensors = weights.tensors
        restack = {s: parts for s, parts in self._expert_stacks.items()
                   if s not in tensors and any(p in tensors for p in parts)}
        if restack:  # per-expert HF tensors -> the engine's stacks (one jitted program, shardings kept)
            missing = [p for parts in restack.values() for p in parts if p not in tensors]
            if missing:
                raise ValueError(f"weight names do not match the engine: missing {sorted(missing)[:5]}")
            for s, parts in restack.items():
                want_shape = tuple(self._names[s][...].shape[1:])
                for p in parts:
                    if tuple(tensors[p].shape) != want_shape:
                        raise ValueError(f"shape mismatch for {p}: engine has {want_shape}, update has "
                                         f"{tuple(tensors[p].shape)}")
            dtypes = tuple((s, jnp.dtype(self._names[s][...].dtype).name) for s in sorted(restack))
            shardings = {s: self._names[s][...].sharding for s, _ in dtypes}
            stacked = _restack_jit(shardings, dtypes)({s: [tensors[p] for p in restack[s]] for s, _ in dtypes})
            done = {p for parts in restack.values() for p in parts}
            tensors = {**{k: v for k, v in tensors.items() if k not in done}, **stacked}
        got, want = {k for k in tensors if not is_kv_scale_name(k)}, set(self._names)
        hf_fused = self._fused_part_names  # the HF names of fused groups' parts (stacks restacked above)
        hf_naming = bool(got & (hf_fused - want))  # the weights name the parts of a fused group
        if hf_naming:
            want = hf_fused
        if got != want:
            raise ValueError(f"weight names do not match the engine: missing {sorted(want - got)[:5]}, "
                             f"unexpected {sorted(got - want)[:5]}")
        if hf_naming:  # concatenate each fused group's parts (one jitted program; a copy of those tensors)
            parts = want - set(self._names)
            tensors = {**{k: v for k, v in tensors.items() if k not in parts},
                       **_fuse_jit({k: tensors[k] for k in parts}, groups=self.fused_projections)}
        self._apply_kv_scales(weights)  # before touching weights: malformed scales leave the engine unchanged
        for name, var in self._names.items():
            new = tensors[name]
            old = var[...]
            if tuple(new.shape) != tuple(old.shape):
                raise ValueError(f"shape mismatch for {name}: engine has {tuple(old.shape)}, update has {tuple(new.shape)}")
            if jnp.dtype(new.dtype) != old.dtype:
                new = jnp.asarray(new, old.dtype)
            var[...] = new
        self._place_on_mesh()
        self.weights_version = weights.version
        self.last_sync_s = time.perf_counter() - t0

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling_params: SamplingParams,
                 expected_version: int | None = None, *, row_offset: int = 0) -> RolloutBatch:
        """Sample completions (see :class:`RolloutBatch` for shapes).

        For an MoE model the batch carries the routing record of rollout routing replay (R3, arXiv 2510.11370):
        ``routed_experts`` int32 ``[N, T, L, k]`` (each response token's top-k experts per layer, recorded when
        the decode step fed it; -1 for dense layers and after a row's end) and ``prompt_routed_experts`` (the
        prefill's record, ``[len(prompt), L, k]`` per row). Dense models: both None.

        Args:
          prompt_token_ids: B prompts (lists of ids, at least one id each).
          sampling_params: vLLM-style sampling parameters.
          expected_version: when given, refuse to generate with weights of an older version.
          row_offset: index of this call's first row in a larger batch. Sampling noise is keyed per row: row
            ``r``'s token at step ``t`` uses ``fold_in(fold_in(key(seed), row_offset + r), t)``, so a batch split
            into parts (KV-budget chunks, or several processes each generating a slice of the prompts with
            ``row_offset = first_prompt * n``) samples what the whole batch would (up to float rounding of a
            different batch shape).

        Raises:
          ValueError: an empty prompt, a token id outside the vocabulary, or one prompt's n samples not fitting
            in ``kv_cache_memory_bytes``.
          StaleWeightsError: ``expected_version`` is newer than the loaded weights.
          StaleKVScalesError: FP8 KV cache whose scales are older than the weights (or were never set).
        """
        check_weights_current(self.weights_version, expected_version, self.kv_cache_dtype, self.kv_scales_version)
        sp = sampling_params
        prompts = check_prompt_token_ids(prompt_token_ids, self.config.vocab_size)
        rows = [r for r in prompts for _ in range(sp.n)]
        b = len(rows)
        # Each prompt is prefilled once and its KV cache shared by its n samples (as vLLM's prefix cache).
        ids, mask = left_pad(prompts, self.pad_token_id, self.prompt_bucket)
        chunk = len(prompts)
        if self.kv_capacity is not None:  # byte budget: run at most max-concurrency sequences at once
            seq_len = ids.shape[1] + sp.max_tokens
            fit = self.kv_capacity.max_sequences(seq_len)
            chunk = min(len(prompts), fit // sp.n)
            if chunk < 1:
                raise ValueError(f"kv_cache_memory_bytes={self.kv_capacity.memory_bytes} holds "
                                 f"{self.kv_capacity.num_tokens} {self.kv_cache_dtype} tokens = {fit} sequence(s) of "
                                 f"{seq_len} tokens, fewer than the n={sp.n} samples of one prompt")
        self.last_num_chunks = -(-len(prompts) // chunk)
        stop = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(self.eos_token_ids))
        stop_arr = np.array(sorted(stop) or [-1], np.int32)
        if isinstance(row_offset, bool) or not isinstance(row_offset, (int, np.integer)) or row_offset < 0:
            raise ValueError(f"row_offset must be an int >= 0, got {row_offset!r}")
        if sp.seed is not None:
            key = jax.random.key(sp.seed)
        else:
            self._key, key = jax.random.split(self._key)
        greedy = sp.temperature == 0
        use_top_k = (not greedy) and sp.top_k > 0 and sp.top_k < self.config.vocab_size
        use_top_p = (not greedy) and sp.top_p < 1.0
        fp8 = self.kv_cache_dtype == "fp8_e4m3"
        scales = (self.kv_scales.k_scale, self.kv_scales.v_scale,
                  self.kv_scales.q_scale if self.fp8_attention else None) if fp8 else (None, None, None)
        outs = []
        for c0 in range(0, len(prompts), chunk):  # rows keep their noise whatever the chunking (row-keyed)
            outs.append(_generate(
                self.graphdef, self.state, self._batch_input(ids[c0:c0 + chunk]),
                self._batch_input(mask[c0:c0 + chunk]), key, jnp.int32(row_offset + c0 * sp.n),
                jnp.float32(max(sp.temperature, 1e-6)), jnp.int32(max(sp.top_k, 1)), jnp.float32(sp.top_p),
                jnp.asarray(stop_arr), *scales, n=sp.n, max_tokens=sp.max_tokens, greedy=greedy,
                use_top_k=use_top_k, use_top_p=use_top_p, pad_token_id=self.pad_token_id,
                cache_dtype=self.cache_dtype, record_routing=self.records_routing))
        toks, lps, lengths = (np.concatenate([np.asarray(o[i]) for o in outs]) for i in range(3))
        resp_mask = (np.arange(sp.max_tokens)[None] < lengths[:, None]).astype(np.float32)
        ended = [bool(lengths[i] > 0 and toks[i, lengths[i] - 1] in stop) for i in range(b)]
        routed = prompt_routed = None
        if self.records_routing:  # R3 record: response [N, T, L, k]; prompt rows sliced from the left padding
            routed = np.concatenate([np.asarray(o[3]) for o in outs]).astype(np.int32)
            pr = np.concatenate([np.asarray(o[4]) for o in outs]).astype(np.int32)  # [U, P, L, k]
            p_len = ids.shape[1]
            prompt_routed = [pr[i, p_len - len(x):] for i, x in enumerate(prompts) for _ in range(sp.n)]
        return RolloutBatch(
            prompt_token_ids=rows, response_token_ids=toks, rollout_logprobs=(lps * resp_mask).astype(np.float32),
            response_mask=resp_mask, finish_reason=["stop" if e else "length" for e in ended],
            prompt_index=np.repeat(np.arange(len(prompt_token_ids), dtype=np.int32), sp.n),
            weights_version=self.weights_version, routed_experts=routed, prompt_routed_experts=prompt_routed)

    def score(self, prompt_token_ids: Sequence[Sequence[int]],
              continuation_ids: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Logprobs (temperature 1, raw logits) of fixed continuations under the served weights, KV cache included.

        The same question as :meth:`rollout_bridge.vllm_engine.VllmRolloutEngine.score` (vLLM ``prompt_logprobs``):
        one prefill of ``prompt + continuation`` through the engine's own weights and cache dtype (an e4m3 cache
        is written and read with the served ``k_scale``/``v_scale``), used to check that a sync landed
        (:mod:`fp8rl_jax.rollout.verify`).

        Returns:
          per prompt, float32 ``[len(continuation_i)]``.

        Raises:
          ValueError: empty prompts or continuations, or ids outside the vocabulary.
          StaleKVScalesError: FP8 KV cache whose scales were never set.
        """
        check_weights_current(self.weights_version, None, self.kv_cache_dtype, self.kv_scales_version)
        prompts = check_prompt_token_ids(prompt_token_ids, self.config.vocab_size)
        conts = check_prompt_token_ids(continuation_ids, self.config.vocab_size)
        if len(conts) != len(prompts):
            raise ValueError(f"score: {len(prompts)} prompts but {len(conts)} continuations")
        t = max(len(c) for c in conts)
        ids, mask = left_pad(prompts, self.pad_token_id, self.prompt_bucket)
        cont = np.full((len(conts), t), self.pad_token_id, np.int32)
        for i, c in enumerate(conts):
            cont[i, :len(c)] = c
        scales = ((self.kv_scales.k_scale, self.kv_scales.v_scale,
                   self.kv_scales.q_scale if self.fp8_attention else None)
                  if self.kv_cache_dtype == "fp8_e4m3" else (None, None, None))
        lp = np.asarray(_score(self.graphdef, self.state, jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(cont),
                               *scales, cache_dtype=self.cache_dtype))
        return [lp[i, :len(c)].astype(np.float32) for i, c in enumerate(conts)]

    def named_weights(self) -> dict[str, jax.Array]:
        """The served weights under the HF checkpoint names, ``{hf_name: array}`` (what an unfused export names).

        Unfused tensors are the live arrays; each fused ``qkv_proj`` / ``gate_up_proj`` tensor is returned as its
        parts' row slices (copies), each stacked expert tensor as its per-expert slices (copies). For checks and
        digests; ``update_weights`` takes either naming.
        """
        return split_expert_stacks(split_tensors({k: v[...] for k, v in self._names.items()},
                                                 self.fused_projections))

    def served_kv_scales(self) -> np.ndarray | None:
        """The ``k_scale``/``v_scale`` the engine uses, float32 ``[num_layers, 2]`` (None without scales)."""
        if self.kv_scales is None:
            return None
        return np.stack([np.asarray(self.kv_scales.k_scale), np.asarray(self.kv_scales.v_scale)], 1).astype(np.float32)

    @property
    def served_precision(self) -> str:
        """What this engine actually computes with: ``"fp8"`` (W8A8 blockwise), ``"bf16"`` or ``"float32"``, plus
        ``" + e4m3 KV cache"`` with an FP8 cache."""
        return self.precision + (" + e4m3 KV cache" if self.kv_cache_dtype == "fp8_e4m3" else "")

    def __repr__(self) -> str:
        c = self.config
        mesh = "" if self.mesh is None else f", mesh {dict(self.mesh.shape)}"
        return (f"JaxRolloutEngine({c.model_type} {c.num_hidden_layers} layers x {c.hidden_size}, "
                f"{self.served_precision}, weights version {self.weights_version}, "
                f"{len(self.fused_projections)} fused projection groups{mesh})")

    def close(self) -> None:
        """Drop the weights and compiled programs."""
        self.state = None
        self._names = {}


# the engine's load program for weights that arrive under the HF names: each group's row concatenation
_fuse_jit = jax.jit(fuse_tensors, static_argnames=("groups",))


@functools.lru_cache(maxsize=8)
def _restack_program(shardings: tuple, dtypes: tuple):
    out_sh = {s: sh for s, sh in shardings}
    return jax.jit(lambda parts: {s: jnp.stack(parts[s]).astype(dt) for s, dt in dtypes}, out_shardings=out_sh)


def _restack_jit(shardings: dict, dtypes: tuple):
    """The engine's restacking program for per-expert expert tensors: ``{stack: [E arrays]} -> {stack: [E, ...]}``
    cast to the stacks' dtypes and placed with their shardings (one ``jax.jit``, cached by shardings and dtypes)."""
    return _restack_program(tuple(sorted(shardings.items(), key=lambda kv: kv[0])), dtypes)


@functools.partial(jax.jit, static_argnames=("cache_dtype",))
def _score(graphdef, state, ids, mask, cont, k_scale=None, v_scale=None, q_scale=None, *, cache_dtype):
    """Teacher-forced logprobs of ``cont [B, T]`` after left-padded ``ids [B, P]``, through a fresh KV cache."""
    model = nnx.merge(graphdef, state)
    (u, p), t = ids.shape, cont.shape[1]
    cache = KVCache.zeros(model.config, u, p + t, cache_dtype, k_scale=k_scale, v_scale=v_scale, q_scale=q_scale)
    kv_mask = jnp.concatenate([mask, jnp.ones((u, t), bool)], axis=1)
    h, _ = model.hidden_states(jnp.concatenate([ids, cont], axis=1), positions_from_mask(kv_mask), kv_mask, cache, 0)
    logp = jax.nn.log_softmax(model.logits(h[:, p - 1:p + t - 1]), axis=-1)
    return jnp.take_along_axis(logp, cont[..., None], axis=-1)[..., 0]


@functools.partial(jax.jit, static_argnames=("n", "max_tokens", "greedy", "use_top_k", "use_top_p", "pad_token_id",
                                             "cache_dtype", "record_routing"))
def _generate(graphdef, state, ids, mask, key, row_offset, temperature, top_k, top_p, stop_ids, k_scale=None,
              v_scale=None, q_scale=None, *, n, max_tokens, greedy, use_top_k, use_top_p, pad_token_id, cache_dtype,
              record_routing=False):
    """Prefill + decode loop. Returns ``(toks [B, T], lps [B, T], lengths [B])`` and, with ``record_routing`` (an
    MoE model), ``resp_routing`` int32 ``[B, T, L, k]`` (-1 after a row's end) and ``prompt_routing`` int32
    ``[U, P, L, k]`` (the prefill's router top-k of the left-padded prompts, padding included): the rollout
    routing record of R3 (arXiv 2510.11370). Row ``r`` samples step ``t`` with the key
    ``fold_in(fold_in(key, row_offset + r), t)`` (int32 scalar ``row_offset``: see ``generate``)."""
    model = nnx.merge(graphdef, state)
    cfg = model.config
    u, p = ids.shape
    cache = KVCache.zeros(cfg, u, p + max_tokens, cache_dtype, k_scale=k_scale, v_scale=v_scale,
                          q_scale=q_scale)
    kv_mask = jnp.concatenate([mask, jnp.ones((u, max_tokens), bool)], axis=1)
    positions = positions_from_mask(mask)
    if record_routing:
        h, cache, prompt_routing = model.hidden_states(ids, positions, kv_mask, cache, 0, return_routing=True)
    else:
        h, cache = model.hidden_states(ids, positions, kv_mask, cache, 0)
    logits = model.logits(h[:, -1])
    next_pos = positions[:, -1] + 1
    if n > 1:  # share each prompt's prefill among its n samples
        ck, cv, logits, kv_mask, next_pos = jax.tree.map(lambda x: jnp.repeat(x, n, axis=0),
                                                         (cache.k, cache.v, logits, kv_mask, next_pos))
        cache = cache._replace(k=ck, v=cv)  # per-layer scales are not per-row
    b = u * n
    route_shape = (b, max_tokens, cfg.num_hidden_layers, cfg.num_experts_per_tok) if record_routing else (b, 0)

    def cond(carry):
        step, _, _, _, _, done, _, _ = carry
        return (step < max_tokens) & ~jnp.all(done)

    row_keys = jax.vmap(lambda r: jax.random.fold_in(key, r))(row_offset + jnp.arange(b, dtype=jnp.int32))

    def body(carry):
        step, cache, logits, toks, lps, done, pos, routes = carry
        sub = jax.vmap(lambda k: jax.random.fold_in(k, step))(row_keys)  # [b] keys: noise keyed by (row, step)
        tok, lp = sample_tokens(sub, logits, temperature, top_k, top_p, greedy=greedy, use_top_k=use_top_k,
                                use_top_p=use_top_p)
        live = ~done  # this step's token is part of the response (the stop token included)
        tok = jnp.where(done, pad_token_id, tok)
        lp = jnp.where(done, 0.0, lp)
        toks = toks.at[:, step].set(tok)
        lps = lps.at[:, step].set(lp)
        done = done | jnp.any(tok[:, None] == stop_ids[None, :], axis=-1)
        if record_routing:
            h, cache, r = model.hidden_states(tok[:, None], pos[:, None], kv_mask, cache, p + step,
                                              return_routing=True)
            routes = routes.at[:, step].set(jnp.where(live[:, None, None], r[:, 0], -1))
        else:
            h, cache = model.hidden_states(tok[:, None], pos[:, None], kv_mask, cache, p + step)
        return step + 1, cache, model.logits(h[:, 0]), toks, lps, done, pos + 1, routes

    init = (jnp.int32(0), cache, logits, jnp.full((b, max_tokens), pad_token_id, jnp.int32),
            jnp.zeros((b, max_tokens), jnp.float32), jnp.zeros((b,), bool), next_pos,
            jnp.full(route_shape, -1, jnp.int32))
    _, _, _, toks, lps, done, _, routes = jax.lax.while_loop(cond, body, init)
    # length = index of the first stop token + 1, else max_tokens
    is_stop = jnp.any(toks[:, :, None] == stop_ids[None, None, :], axis=-1)
    first = jnp.where(jnp.any(is_stop, axis=1), jnp.argmax(is_stop, axis=1) + 1, max_tokens)
    if record_routing:
        return toks, lps, first.astype(jnp.int32), routes, prompt_routing
    return toks, lps, first.astype(jnp.int32)
