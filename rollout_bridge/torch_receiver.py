"""A torch consumer of the per-step weight sync: copy every synced tensor into preallocated torch parameters.

:class:`TorchParamsReceiver` is the receiving end for a torch model that is not vLLM (a custom sampler, a
reward model sharing the policy's weights, a test harness): it owns or is given ``{hf_name: torch.Tensor}`` and,
on every sync, overwrites each of them in place with the received bytes. It works behind every transport of
:mod:`rollout_bridge.transports` (in-process DLPack views, shared-memory or CUDA IPC buckets, a broadcast
group), so the same object measures and serves all of them.

The copy is a byte copy (:func:`rollout_bridge.transports.copy_many`): ``numpy.copyto`` (``memcpy``) spread
over a few threads on CPU, one device ``copy_`` per tensor on GPU. A dtype-typed ``torch`` ``copy_`` on CPU runs
an element-wise kernel that reaches about half of ``memcpy``'s bandwidth on one thread (measured on the 2-core
Xeon of ``benchmarks/results/weight_sync_cpu.md``: ``per-tensor copy`` against ``floor``), which is what vLLM's
weight loaders pay (they ``param.data.copy_(loaded_weight)``); a byte copy of a same-dtype, same-shape tensor
gives the same result at the memory-bandwidth floor.

Behind the streamed shared-memory transport it declares itself a ring reader (``_fp8rl_ring_reader``): the sender
then streams through a small shared-memory ring and the receiver copies each slot into its tensors as soon as it
is filled (:meth:`rollout_bridge.transports.ShmRingStream.copy_into`, one thread, every destination checked
before the first byte moves), so the payload passes between the two copies in the caches.
"""

from __future__ import annotations

from typing import Any, Mapping

from rollout_bridge.transports import WeightReceiverMixin, _as_bytes, copy_many


def _require_contiguous(name: str, t) -> None:
    if not t.is_contiguous():
        raise ValueError(f"preallocated tensor {name} is not contiguous; the receiver writes it in place as one flat "
                         "buffer")


class _Spec:
    """Shape, dtype and device of a tensor announced by a ring stream (what :meth:`TorchParamsReceiver._destination`
    checks and allocates from)."""

    def __init__(self, entry):
        import torch

        self.shape, self.dtype, self.device = tuple(entry.shape), getattr(torch, entry.dtype), torch.device("cpu")


class TorchParamsReceiver(WeightReceiverMixin):
    """Receiver that writes each synced tensor into the preallocated torch tensor of the same name.

    Args:
      params: ``{hf_name: torch.Tensor}`` to overwrite in place (e.g. ``dict(module.named_parameters())`` of a
        model whose names follow the export's HF names; every tensor contiguous). ``None``: start empty.
      allocate: create a tensor for a name not in ``params`` on its first sync (on ``device``, or on the
        incoming tensor's device); ``False``: an unknown name is an error.
      device: device for allocated tensors (``"cpu"``, ``"cuda:0"``; default: the incoming tensor's).
      copy_threads: host copy threads (default :func:`rollout_bridge.transports.default_copy_threads`).

    Attributes:
      params: the tensors written (the caller's own objects, plus allocated ones).
      kv_scales: ``{layer_index: {"k_scale": float, ...}}`` of the last sync.

    Raises (from a sync, wrapped by the transport into :class:`rollout_bridge.transports.WeightSyncError`):
      KeyError: a name not in ``params`` with ``allocate=False``.
      ValueError: a received tensor whose shape or dtype differs from its preallocated tensor (named), or a
        preallocated tensor that is not contiguous (an in-place byte copy needs one flat buffer).

    The receiver's version stays ``-1`` until every tensor of a sync is written
    (:class:`~rollout_bridge.transports.WeightReceiverMixin`), so a failed sync is never mistaken for a complete one.
    """

    _BATCH = 64  # tensors per copy_many call from a stream (while a bucket's views are alive); a list: one call
    _fp8rl_ring_reader = True  # copies a shared-memory ring stream straight into its tensors (ShmRingStream)

    def __init__(self, params: Mapping[str, Any] | None = None, *, allocate: bool = True, device=None,
                 copy_threads: int | None = None):
        self.copy_threads = copy_threads
        self.params = dict(params or {})
        self.allocate = bool(allocate)
        self.device = device
        self.kv_scales: dict[int, dict[str, float]] = {}
        # name -> (tensor, data_ptr, flat uint8 view: numpy on CPU, torch elsewhere), rebuilt when params[name]
        # is another object or was moved
        self._dst_bytes: dict[str, tuple] = {}
        for name, t in self.params.items():
            _require_contiguous(name, t)

    def _destination(self, name: str, t):
        import torch

        dst = self.params.get(name)
        if dst is None:
            if not self.allocate:
                raise KeyError(f"received {name}, which has no preallocated tensor (allocate=False)")
            dst = self.params[name] = torch.empty(t.shape, dtype=t.dtype, device=self.device or t.device)
            return dst
        if tuple(dst.shape) != tuple(t.shape) or dst.dtype != t.dtype:
            raise ValueError(f"{name}: preallocated {tuple(dst.shape)} {dst.dtype}, received {tuple(t.shape)} "
                             f"{t.dtype}")
        return dst

    def _fp8rl_load(self, named, kv_scales, version) -> None:
        import torch

        copy_into = getattr(named, "copy_into", None)
        if copy_into is not None:  # a shared-memory ring: every destination is checked before the first byte moves
            dsts = [_as_bytes(self._destination(e.name, _Spec(e))) for e in named.entries]
            if all(d.device.type == "cpu" for d in dsts):
                copy_into(dsts)  # one thread: the sender fills the ring on the other core
                self.kv_scales = {int(k): {kk: float(vv) for kk, vv in v.items()}
                                  for k, v in (kv_scales or {}).items()}
                return
        batch = None if isinstance(named, (list, tuple)) else self._BATCH  # a list's tensors are all alive
        on_cuda, pairs, held = False, [], []
        params, cache = self.params, self._dst_bytes
        for name, t in named:  # a stream (shm, broadcast) yields a bucket's tensors once the bucket has landed
            dst, c = params.get(name), cache.get(name)
            if (c is None or c[0] is not dst or c[1] != dst.data_ptr() or dst.shape != t.shape
                    or dst.dtype != t.dtype or not dst.is_contiguous()):  # replaced, moved or re-laid out in place
                c = self._dst_view(name, t)
            if c[0].is_cpu and t.is_cpu:
                pairs.append((c[2], _as_bytes(t).numpy()))
            else:  # a device copy (either side on a GPU): torch byte views of both
                on_cuda = on_cuda or c[0].is_cuda or t.is_cuda
                pairs.append((_as_bytes(c[0]), _as_bytes(t)))
            held.append(t)
            if batch is not None and len(pairs) >= batch:
                copy_many(pairs, self.copy_threads)
                pairs, held = [], []
        copy_many(pairs, self.copy_threads)
        if on_cuda:  # the device copies were queued non-blocking: the version is recorded after they land
            torch.cuda.synchronize()
        self.kv_scales = {int(k): {kk: float(vv) for kk, vv in v.items()} for k, v in (kv_scales or {}).items()}

    def _dst_view(self, name: str, t) -> tuple:
        """Check (or allocate) ``name``'s destination for ``t`` and cache its byte view (see ``_dst_bytes``)."""
        dst = self._destination(name, t)
        _require_contiguous(name, dst)
        flat = _as_bytes(dst)
        c = self._dst_bytes[name] = (dst, dst.data_ptr(), flat.numpy() if dst.is_cpu else flat)
        return c
