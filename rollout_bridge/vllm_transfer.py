"""Per-step weight sync through vLLM's own weight-transfer API (``vllm.distributed.weight_transfer``, vLLM 0.32).

vLLM's workers expose one lifecycle for RL weight updates: ``init_weight_transfer_engine(init_info)`` once, then per
update ``start_weight_update()`` (vLLM's layerwise reload starts), ``update_weights(update_info)`` (the engine
receives checkpoint-format tensors and feeds ``model.load_weights``) and ``finish_weight_update()`` (the reload
finalizes: ``process_weights_after_loading`` per layer). :class:`VllmWeightTransferTransport` drives it from the
trainer, so the receiving side is vLLM's code, not ours:

- ``backend="nccl"`` (CUDA; across hosts): vLLM's ``NCCLWeightTransferEngine`` on the workers and vLLM's
  ``NCCLTrainerWeightTransferEngine`` here (packed, double-buffered broadcast from rank 0), fed the step's torch
  views (a :class:`_TensorSource`). The achieved bandwidth is ``SyncStats.gb_per_s``.
- ``backend="fp8rl_gloo"`` (CPU, where vLLM's NCCL engine cannot run): :class:`GlooWeightTransferEngine`, registered
  in vLLM's ``WeightTransferEngineFactory`` under that name. The same lifecycle and layerwise reload; the bytes travel
  as gloo broadcasts of this package's buckets (:func:`rollout_bridge.transports.plan_buckets`), which the worker
  loads bucket by bucket as they land (:class:`rollout_bridge.transports.BucketStream`).

Our worker extension (:class:`rollout_bridge.vllm_worker.WeightSyncExtension`) brackets every update: it reports
version ``-1`` from before ``start_weight_update`` until the KV scales are written and the version recorded after
``finish_weight_update``, so a half-applied update is never taken for a complete one. A worker started without
``weight_transfer_config`` gets the engine created on the first sync (``fp8rl_ensure_weight_transfer``).

Not verified on a GPU: the ``nccl`` backend path (it is vLLM's code end to end; the CPU tests run ``fp8rl_gloo``
through the same vLLM worker methods).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

from rollout_bridge.transports import (DEFAULT_BUCKET_BYTES, BucketStream, Receiver, SyncStats, TensorEntry, Transport,
                                       WeightSyncError, _make_group, _payload_bytes, _wait_all, broadcast_streamed,
                                       free_port, plan_buckets)

GLOO_BACKEND = "fp8rl_gloo"
BACKENDS = ("nccl", GLOO_BACKEND)


def _engine_classes():
    """Build the worker-side gloo engine classes (vLLM imported lazily: this module loads without vLLM)."""
    from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                       WeightTransferUpdateInfo)

    @dataclasses.dataclass(kw_only=True)
    class GlooWeightTransferInitInfo(WeightTransferInitInfo):
        """Where the trainer's gloo group is (``TCPStore`` at ``master_address:master_port``, trainer rank 0) and
        this engine's first rank (``rank_offset``; a worker adds its global rank in its DP x TP x PP group)."""

        master_address: str
        master_port: int
        rank_offset: int
        world_size: int
        timeout_s: float = 600.0

    @dataclasses.dataclass
    class GlooWeightTransferUpdateInfo(WeightTransferUpdateInfo):
        """One update: the bucket plan (``TensorEntry`` tuples: name, bucket, byte offset, byte size, shape, torch
        dtype name) and each bucket's size in bytes, broadcast from rank 0 in order."""

        entries: list
        sizes: list

    class GlooWeightTransferEngine(WeightTransferEngine[GlooWeightTransferInitInfo, GlooWeightTransferUpdateInfo]):
        """vLLM weight-transfer engine over a gloo broadcast group (CPU workers; see the module docstring).

        ``start_weight_update`` / ``finish_weight_update`` run vLLM's layerwise reload as its NCCL engine does;
        ``receive_weights`` loads each broadcast bucket as it lands. A load that raises part way drains the remaining
        buckets (the trainer never hangs on a broadcast) and undoes the partial reload
        (:func:`rollout_bridge.vllm_worker.abort_layerwise_reload`) before the error reaches vLLM's worker.
        """

        init_info_cls = GlooWeightTransferInitInfo
        update_info_cls = GlooWeightTransferUpdateInfo
        supports_draft_weight_update = False

        def __init__(self, config, vllm_config, device, model):
            super().__init__(config, vllm_config, device, model)
            self.group = None

        def init_transfer_engine(self, init_info) -> None:
            pc = self.parallel_config
            rank = init_info.rank_offset + pc.data_parallel_index * pc.world_size + pc.rank
            self.group = _make_group(init_info.master_address, init_info.master_port, init_info.world_size, rank,
                                     "gloo", float(init_info.timeout_s))

        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)

        def update_weights(self, update_info: dict) -> None:
            # the base class ends with torch.accelerator.synchronize(), which raises on a CPU-only host
            self.receive_weights(self.parse_update_info(update_info))

        def receive_weights(self, update_info) -> None:
            import torch

            from rollout_bridge.vllm_worker import abort_layerwise_reload

            if self.group is None:
                raise RuntimeError("fp8rl_gloo weight transfer not initialized: call init_weight_transfer_engine first")
            stream = BucketStream(self.group, update_info.sizes, [TensorEntry(*e) for e in update_info.entries],
                                  "cpu")
            try:
                with torch.no_grad():
                    self.model.load_weights(iter(stream))
            except BaseException:
                abort_layerwise_reload(self.model)
                raise
            finally:
                stream.drain()

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            from rollout_bridge.vllm_worker import abort_layerwise_reload

            try:
                finalize_layerwise_reload(self.model, self.model_config)
            except BaseException:
                abort_layerwise_reload(self.model)
                raise

        def shutdown(self) -> None:
            self.group = None

    return GlooWeightTransferEngine


def register_gloo_backend() -> None:
    """Register :data:`GLOO_BACKEND` in vLLM's ``WeightTransferEngineFactory`` (idempotent; done on import of
    :mod:`rollout_bridge.vllm_worker`, which vLLM imports in every worker as our ``worker_extension_cls``).

    Raises:
      ImportError: vLLM is not installed, or has no ``vllm.distributed.weight_transfer`` (before 0.2x).
    """
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(GLOO_BACKEND, _engine_classes())
    except ValueError:  # already registered in this process
        pass


def default_backend() -> str:
    """``"nccl"`` where torch sees CUDA, else :data:`GLOO_BACKEND`."""
    import torch

    return "nccl" if torch.cuda.is_available() else GLOO_BACKEND


class _FanOutClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol over our :class:`~rollout_bridge.transports.Receiver` handles: each
    call runs on every receiver and waits for all (an error names the receiver)."""

    def __init__(self, receivers: Sequence[Receiver], timeout_s: float, version: int = -1):
        self.receivers, self.timeout_s, self.version = tuple(receivers), timeout_s, version

    def _all(self, method: str, *args):
        pend = [r.call(method, *args) for r in self.receivers]
        return _wait_all(self.receivers, pend, method, self.timeout_s, self.version)

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._all("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self._all("start_weight_update")

    def update_weights(self, update_info) -> None:
        self._all("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._all("finish_weight_update")


def _tensor_source(tensors: dict):
    """vLLM ``WeightSource`` over ``{name: torch.Tensor}`` (names and order as given)."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class _TensorSource(WeightSource):
        def metadata(self):
            return [ParamMeta(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()]

        def __iter__(self):
            return iter(tensors.items())

    return _TensorSource()


class VllmWeightTransferTransport(Transport):
    """Sync through vLLM's weight-transfer API (see the module docstring).

    Args:
      backend: ``"nccl"`` (CUDA workers; vLLM's own engine on both sides), :data:`GLOO_BACKEND` (CPU) or None
        (:func:`default_backend`).
      host: address the workers reach this process's ``TCPStore`` at (set this node's IP when vLLM's workers run
        on other hosts; the default only reaches workers on this one).
      port: store port (default: a free one).
      bucket_bytes: gloo bucket size; for ``nccl`` the size of each of vLLM's two packed buffers on the trainer.
      timeout_s: group and RPC timeout (seconds).
      workers_per_receiver: workers (TP x PP x DP ranks) behind each receiver; None: as many as answer the first
        ``collective_rpc``.

    Raises:
      ValueError: unknown backend; ``"nccl"`` with more than one receiver (vLLM's trainer engine addresses one
        engine's workers, at rank offset 1); ``"nccl"`` with a worker on the trainer's own GPU (NCCL cannot put two
        ranks of a group on one device: use the ``shm`` transport, CUDA IPC, there).

    A failed sync (any error, or a timeout of an RPC) shuts the group down, asks every worker to undo a partial
    layerwise reload and end vLLM's update session (``fp8rl_abort_external_load``, best effort) and raises
    :class:`~rollout_bridge.transports.WeightSyncError`; the next sync forms a new group. With ``nccl`` a worker
    that dies in the middle of a broadcast leaves the trainer blocked in NCCL (vLLM's engine has no timeout there).
    """

    name = "vllm"

    def __init__(self, backend: str | None = None, host: str = "127.0.0.1", port: int | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout_s: float = 600.0,
                 workers_per_receiver: int | None = None):
        backend = backend or default_backend()
        if backend not in BACKENDS:
            raise ValueError(f"unknown vLLM weight-transfer backend {backend!r}; expected one of {BACKENDS}")
        self.backend, self.host, self.port = backend, host, port
        self.bucket_bytes, self.timeout_s = int(bucket_bytes), float(timeout_s)
        self.wpr = None if workers_per_receiver is None else int(workers_per_receiver)
        self.group = None  # gloo: our rank-0 group; nccl: vLLM's trainer engine
        self._receivers: tuple = ()
        self._buf = None

    def _ensure(self, receivers: Sequence[Receiver]) -> int:
        """Create the workers' engines where vLLM did not; returns the workers per receiver."""
        pend = [r.call("fp8rl_ensure_weight_transfer", self.backend) for r in receivers]
        counts, devices = [], []
        for r, p in zip(receivers, pend):
            try:
                got = p.result(timeout=self.timeout_s)
            except Exception as e:  # noqa: BLE001
                raise WeightSyncError(f"{r.name}: could not create vLLM's {self.backend!r} weight-transfer engine: "
                                      f"{type(e).__name__}: {e}") from e
            got = got if isinstance(got, (list, tuple)) else [got]  # collective_rpc: one answer per worker
            counts.append(len(got))
            devices += [g[1] for g in got if isinstance(g, (list, tuple)) and g[1]]
        if self.backend == "nccl":
            import torch

            own = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
            if own in devices:
                raise ValueError(f"a vLLM worker runs on the trainer's GPU ({own}); NCCL cannot connect two ranks on "
                                 "one device: use transport='shm' (CUDA IPC) for colocated workers")
        return self.wpr or max(counts)

    def connect(self, receivers: Sequence[Receiver]) -> None:
        """Create the workers' engines if vLLM did not, and form the transfer group (idempotent for one receiver
        set).

        Raises:
          WeightSyncError: a worker failed to create or join within ``timeout_s``.
          ValueError: see the class docstring.
        """
        if self.group is not None and tuple(receivers) == self._receivers:
            return
        if self.backend == "nccl" and len(receivers) != 1:
            raise ValueError(f"backend 'nccl' drives one vLLM engine (got {len(receivers)} receivers); use one "
                             "VllmWeightTransferTransport per engine")
        wpr = self._ensure(receivers)
        port = self.port or free_port(self.host)
        world = 1 + wpr * len(receivers)
        try:
            if self.backend == "nccl":
                from vllm.distributed.weight_transfer.nccl_engine import (NCCLTrainerInitInfo,
                                                                          NCCLTrainerWeightTransferEngine)

                info = NCCLTrainerInitInfo(master_address=self.host, master_port=port, world_size=world, rank=0,
                                           packed_buffer_size_bytes=self.bucket_bytes)
                self.group = NCCLTrainerWeightTransferEngine.trainer_init(
                    info, client=_FanOutClient(receivers, self.timeout_s), source=_tensor_source({}))
            else:
                pend = [r.call("init_weight_transfer_engine",
                               {"master_address": self.host, "master_port": port, "rank_offset": 1 + i * wpr,
                                "world_size": world, "timeout_s": self.timeout_s})
                        for i, r in enumerate(receivers)]
                self.group = _make_group(self.host, port, world, 0, "gloo", self.timeout_s)
                _wait_all(receivers, pend, "init_weight_transfer_engine", self.timeout_s, -1)
        except Exception as e:  # noqa: BLE001
            self._drop_group()
            if isinstance(e, WeightSyncError):
                raise
            raise WeightSyncError(f"vLLM weight-transfer group ({self.backend}, {self.host}:{port}, world {world}) "
                                  f"did not form: {type(e).__name__}: {e}") from e
        self._receivers = tuple(receivers)

    def send(self, tensors, kv_scales, version, receivers, timeout_s=None) -> SyncStats:
        """See :class:`~rollout_bridge.transports.Transport`: ``start_weight_update`` / ``update_weights`` (with
        the broadcast) / ``finish_weight_update`` on every worker, then KV scales and version.

        Raises:
          ValueError: no tensors.
          WeightSyncError: a worker or the broadcast failed, or a call timed out; the workers report version
            ``-1`` until a later sync completes.
        """
        if not tensors:
            raise ValueError("nothing to sync: the export has no tensors")
        t0 = time.perf_counter()
        self.connect(receivers)
        timeout = float(timeout_s or self.timeout_s)
        client = _FanOutClient(receivers, timeout, version)
        nbuckets = 0
        try:
            client._all("fp8rl_begin_external_load")
            if self.backend == "nccl":
                self.group.client, self.group.source = client, _tensor_source(tensors)
                self.group.send_weights()  # start, update (concurrent with vLLM's packed broadcast), finish
            else:
                nbuckets = self._send_gloo(tensors, client, version)
            pend = [r.call("fp8rl_end_external_load", kv_scales, version) for r in receivers]
            _wait_all(receivers, pend, "load (vLLM weight transfer)", timeout, version)  # checks reported versions
        except Exception as e:  # noqa: BLE001
            self._drop_group()  # a broken group is never reused
            for r in receivers:  # best effort: undo a partial reload, end vLLM's update session
                try:
                    r.call("fp8rl_abort_external_load").result(timeout=min(timeout, 60.0))
                except Exception:  # noqa: BLE001 - the original error is what the caller needs
                    pass
            if isinstance(e, WeightSyncError):
                raise
            raise WeightSyncError(f"vLLM weight transfer of v{version} failed ({self.backend}): "
                                  f"{type(e).__name__}: {e}") from e
        return SyncStats(self.name, _payload_bytes(tensors), time.perf_counter() - t0, nbuckets)

    def _send_gloo(self, tensors: dict, client: _FanOutClient, version: int) -> int:
        entries, sizes = plan_buckets(tensors, self.bucket_bytes)
        info = {"entries": [list(dataclasses.astuple(e)) for e in entries], "sizes": sizes}
        client.start_weight_update()
        pend = [r.call("update_weights", info) for r in client.receivers]
        self._buf = broadcast_streamed(self.group, tensors, entries, sizes, self._buf)
        _wait_all(client.receivers, pend, "update_weights", client.timeout_s, version)
        client.finish_weight_update()
        return len(sizes)

    def _drop_group(self) -> None:
        group, self.group, self._receivers = self.group, None, ()
        shutdown = getattr(group, "shutdown", None)  # vLLM's trainer engine destroys its NCCL communicator
        if shutdown is not None:
            try:
                shutdown()
            except Exception:  # noqa: BLE001 - teardown of a group that already failed
                pass

    def close(self) -> None:
        """Shut the group down (the workers keep their engines; the next sync forms a new group) and free the
        bucket buffer."""
        self._drop_group()
        self._buf = None


__all__ = ["VllmWeightTransferTransport", "register_gloo_backend", "default_backend", "GLOO_BACKEND", "BACKENDS"]
