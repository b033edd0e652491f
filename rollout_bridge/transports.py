"""Weight-sync transports: trainer (sender) -> rollout workers (receivers), three ways behind one interface.

Every transport moves the same thing: ``{hf_name: tensor}`` in checkpoint layout plus per-layer KV scales and
the weights ``version``; every receiver ends in the same place, ``_fp8rl_load(named_tensors, kv_scales,
version)`` (vLLM: the worker's ``reload_weights(..., is_checkpoint_format=True)``; embedded engine:
``update_weights``). Receivers record the version only after a complete load and ``-1`` while a load is in
progress, so a worker that failed mid-sync is recognisably inconsistent, never silently stale.

Transports (``name``):

- ``"inprocess"``: the tensor objects themselves are handed to a receiver in the same process (DLPack views of
  the JAX buffers; no copy before vLLM's own ``copy_`` into its parameters).
- ``"shm"``: cross-process on one node. Tensors are flattened into byte buckets (``bucket_bytes`` each, 64-byte
  aligned offsets); on CPU the buckets are POSIX shared memory (``multiprocessing.shared_memory``), on CUDA they
  are device buffers shared by CUDA IPC handles (``torch.multiprocessing.reductions.reduce_tensor``). Only the
  metadata (names, dtypes, shapes, bucket, offset, nbytes) travels through the RPC. On CPU, receivers that copy
  into their own memory are streamed through a small ring in shared memory instead (:class:`ShmRingStream`), so
  the bytes pass from the sender's copy to the receiver's in the caches rather than through DRAM.
- ``"dist"``: cross-node. A stateless ``torch.distributed`` group (``TCPStore`` + ``ProcessGroupGloo`` on CPU,
  NCCL on GPU) of the trainer (rank 0) and the receivers; buckets are broadcast from rank 0. It never touches
  the default process group, so it coexists with vLLM's own.

Errors are :class:`WeightSyncError` naming the receiver and the cause (dead worker, timeout, version mismatch).
The flattened-bucket design follows slime/verl's bucketed weight update; the stateless group follows vLLM's
``StatelessProcessGroup`` idea (facts only, no code taken).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import time
import uuid
from typing import Any, Callable, Iterable, Protocol, Sequence

ALIGN = 64
DEFAULT_BUCKET_BYTES = 512 << 20
STREAM_BUCKET_BYTES = 64 << 20  # streamed shm: small enough that fill and load overlap
RING_SLOT_BYTES = 512 << 10  # shm ring slot: copied in by the sender, out by the receiver, while still cached
RING_SLOTS = 32  # 16 MiB of ring: room to run ahead of a reader that is not running (a busy host)
RING_LEAD = 2  # chunks the sender keeps ahead of readers that keep pace: 1 MiB, in the cores' L2 (1 MiB here)
TRANSPORTS = ("inprocess", "shm", "dist")


class WeightSyncError(RuntimeError):
    """A weight sync did not complete: the receiver died, timed out, rejected the tensors or reported a wrong
    version. The rollout engine must not be used until a later sync succeeds; the trainer's state is untouched."""


# ---------------------------------------------------------------------------------------------------------------
# flattened buckets
# ---------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives in the flattened buckets.

    Attributes:
      name: HF/vLLM checkpoint name. dtype: torch dtype name (``"bfloat16"``, ``"float8_e4m3fn"``, ...).
      shape: tensor shape. bucket: bucket index. offset: byte offset in the bucket. nbytes: byte length.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    bucket: int
    offset: int
    nbytes: int


def plan_buckets(tensors: dict[str, Any], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> tuple[list[TensorEntry], list[int]]:
    """Assign tensors (in the given order) to byte buckets of at most ``bucket_bytes`` (a larger tensor gets its own).

    Args:
      tensors: ``{name: torch.Tensor}``.
      bucket_bytes: bucket capacity in bytes (> 0).

    Returns:
      ``(entries, bucket_sizes)``; offsets are multiples of 64 bytes so every dtype view is aligned.

    Raises:
      ValueError: ``bucket_bytes`` <= 0.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    entries, sizes = [], [0]
    for name, t in tensors.items():
        n = int(t.numel()) * int(t.element_size())
        start = -(-sizes[-1] // ALIGN) * ALIGN
        if sizes[-1] > 0 and start + n > bucket_bytes:
            sizes.append(0)
            start = 0
        entries.append(TensorEntry(name, str(t.dtype).removeprefix("torch."), tuple(int(s) for s in t.shape),
                                   len(sizes) - 1, start, n))
        sizes[-1] = start + n
    return entries, [max(s, 1) for s in sizes]


def _as_bytes(t):
    """Flat uint8 torch view of a tensor (no copy when contiguous; a 0-d tensor gives its element's bytes)."""
    import torch

    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


_PIECE_BYTES = 512 << 10  # host copies are cut into pieces of at most this many bytes (see copy_many) ...
_HUGE_BYTES = 256 << 20  # ... unless each thread's share of one copy is at least this large
_COPY_POOL: dict[int, concurrent.futures.ThreadPoolExecutor] = {}


def default_copy_threads() -> int:
    """Threads for host-memory byte copies: the CPUs this process may run on, at most 4 (two already reach the
    memory bandwidth of the 2-core machine in ``benchmarks/results/weight_sync_cpu.md``; more only contend)."""
    import os

    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(1, min(4, n))


def _copy_group(pairs) -> None:
    """``numpy.copyto(dst, src)`` for each pair of an iterable (copy threads share one iterator: the GIL hands
    every piece to exactly one of them)."""
    import numpy as np

    copyto = np.copyto
    for d, s in pairs:
        copyto(d, s)


def copy_many(pairs: Sequence[tuple[Any, Any]], threads: int | None = None) -> None:
    """``dst[:] = src`` for every ``(dst, src)`` pair of flat uint8 buffers of equal length.

    A pair is two torch tensors, or (host memory) two numpy arrays. Host copies are cut into pieces of at most
    512 KiB that ``threads`` threads (default :func:`default_copy_threads`, the calling thread one of them;
    ``numpy.copyto`` releases the GIL) take in turn: glibc 2.36 copies such a piece with ``rep movsb``, faster on
    a 2-core AMD EPYC than the ordinary-store loop it uses for 1-288 MiB copies (in-process sync 1.07x the
    memcpy floor against 1.36-1.48x with whole-tensor copies, ``benchmarks/bench_weight_sync.py``). A copy of
    at least ``threads`` x 256 MiB is instead cut into one part per thread, each large enough for glibc's
    non-temporal stores. On GPU the pairs
    go to ``torch._foreach_copy_`` (multi-tensor apply: a few launches for hundreds of tensors; non-blocking:
    synchronize before reading ``dst`` from another stream or process).

    Raises:
      ValueError: a pair whose lengths differ (named by position).
    """
    import numpy as np

    host, rest = [], []
    for i, (d, s) in enumerate(pairs):
        if isinstance(d, np.ndarray) and isinstance(s, np.ndarray):
            if d.size != s.size:
                raise ValueError(f"copy pair {i}: destination has {d.size} bytes, source {s.size}")
            host.append((d, s))
            continue
        if d.numel() != s.numel():
            raise ValueError(f"copy pair {i}: destination has {d.numel()} bytes, source {s.numel()}")
        if d.is_cpu and s.is_cpu:
            host.append((d.numpy(), s.numpy()))
        else:
            rest.append((d, s))
    if rest:
        import torch

        foreach = getattr(torch, "_foreach_copy_", None)
        if foreach is not None:  # one multi-tensor-apply launch per chunk instead of one kernel per tensor
            foreach([d for d, _ in rest], [s for _, s in rest], non_blocking=True)
        else:
            for d, s in rest:
                d.copy_(s, non_blocking=True)
    if not host:
        return
    threads = max(1, int(threads or default_copy_threads()))
    step, huge, pieces = _PIECE_BYTES, [], []
    for d, s in host:
        n = d.size
        if n <= step:
            pieces.append((d, s))
        elif n >= threads * _HUGE_BYTES:  # one part per thread, each large enough for non-temporal stores
            k = -(-n // threads)
            huge += [(d[o:o + k], s[o:o + k]) for o in range(0, n, k)]
        else:
            pieces += [(d[o:o + step], s[o:o + step]) for o in range(0, n, step)]
    pieces = huge + pieces  # the largest first: the threads finish together
    threads = min(threads, len(pieces))
    if threads == 1:
        _copy_group(pieces)
        return
    pool = _COPY_POOL.get(threads - 1)
    if pool is None:
        pool = _COPY_POOL[threads - 1] = concurrent.futures.ThreadPoolExecutor(threads - 1,
                                                                              thread_name_prefix="fp8rl-copy")
    shared = iter(pieces)
    futures = [pool.submit(_copy_group, shared) for _ in range(threads - 1)]
    try:
        _copy_group(shared)
    finally:  # every helper has stopped touching the buffers before this returns or raises
        concurrent.futures.wait(futures)
    for f in futures:
        f.result()  # re-raise a helper's error


def fill_buckets(buckets, tensors: dict[str, Any], entries: Sequence[TensorEntry]) -> None:
    """Copy each tensor's bytes into its bucket slot (``buckets``: uint8 torch tensors indexed by bucket number,
    a list or a ``{bucket: tensor}`` dict), with :func:`copy_many`."""
    copy_many([(buckets[e.bucket][e.offset:e.offset + e.nbytes], _as_bytes(tensors[e.name])) for e in entries])


def entries_by_bucket(entries: Sequence[TensorEntry], num_buckets: int) -> list[list[TensorEntry]]:
    """``entries`` split per bucket index (``[bucket] -> [TensorEntry, ...]``, order kept)."""
    out: list[list[TensorEntry]] = [[] for _ in range(num_buckets)]
    for e in entries:
        out[e.bucket].append(e)
    return out


def unpack_buckets(buckets, entries: Sequence[TensorEntry]) -> list[tuple[str, Any]]:
    """Views ``[(name, tensor)]`` into the buckets (indexed by bucket number: a list or a dict; no copy), with the
    dtypes and shapes of ``entries``."""
    import torch

    out = []
    for e in entries:
        raw = buckets[e.bucket][e.offset:e.offset + e.nbytes]
        out.append((e.name, raw.view(getattr(torch, e.dtype)).reshape(e.shape)))
    return out


# ---------------------------------------------------------------------------------------------------------------
# receiver side
# ---------------------------------------------------------------------------------------------------------------
class WeightReceiverMixin:
    """The receiving end of every transport (mixed into vLLM's worker and the Ray rollout actor).

    Subclasses implement ``_fp8rl_load(named: list[(name, torch.Tensor)], kv_scales: {layer: {"k_scale": f}},
    version: int) -> None``. Public methods are prefixed ``fp8rl_`` so they never shadow vLLM ``Worker``
    attributes (vLLM refuses conflicting ``worker_extension_cls`` attributes).
    """

    _fp8rl_version: int = -1
    _fp8rl_group = None
    # True for a receiver whose ``_fp8rl_load`` copies a :class:`ShmRingStream` into its own memory through
    # ``copy_into`` (it keeps no view of the stream): the streamed shm transport then sends through a small ring
    # instead of payload-sized segments. Any other receiver still reads a ring correctly (fresh tensors).
    _fp8rl_ring_reader: bool = False

    def _fp8rl_guarded(self, named, kv_scales, version: int) -> int:
        self._fp8rl_version = -1  # inconsistent until the whole load completed
        self._fp8rl_load(named, kv_scales, version)
        self._fp8rl_version = int(version)
        return self._fp8rl_version

    def _fp8rl_load(self, named, kv_scales, version):  # pragma: no cover - abstract
        raise NotImplementedError

    def fp8rl_weights_version(self) -> int:
        """Version of the last complete load (``-1``: none yet, or the last load failed part way)."""
        return int(self._fp8rl_version)

    def fp8rl_load_tensors(self, named: list, kv_scales: dict, version: int) -> int:
        """In-process transport: ``named`` are the tensors themselves. Returns the loaded version."""
        return self._fp8rl_guarded(list(named), kv_scales, version)

    def fp8rl_shm_ring_reader(self) -> bool:
        """Whether this receiver copies a shared-memory ring stream straight into its own tensors (asked once per
        receiver set by :class:`SharedMemoryTransport`)."""
        return bool(self._fp8rl_ring_reader)

    def fp8rl_load_shm(self, meta: dict, kv_scales: dict, version: int) -> int:
        """Shared-memory transport (CPU): map the segments in ``meta["segments"]`` (kept mapped while the sender
        reuses them, so pages are not faulted in again every step), load from views into them. With
        ``meta["ring"]`` the segment is a ring of slots the sender refills (:class:`ShmRingStream`)."""
        import torch

        if meta.get("ring"):
            return self._fp8rl_load_ring(meta, kv_scales, version)
        names = tuple(meta["segments"])
        cached = getattr(self, "_fp8rl_shm", None)
        if cached is None or cached[0] != names:
            self.fp8rl_release_shm()
            self._fp8rl_shm = (names, _attach_untracked(names))
        segs = self._fp8rl_shm[1]
        buckets = [torch.frombuffer(s.buf, dtype=torch.uint8, count=size) for s, size in zip(segs, meta["sizes"])]
        entries = [TensorEntry(*e) for e in meta["entries"]]
        if meta.get("control"):  # streamed: load bucket k while the sender still fills k+1
            ctl = getattr(self, "_fp8rl_shm_ctl", None)
            if ctl is None or ctl[0] != meta["control"]:
                self._fp8rl_shm_ctl = (meta["control"], _attach_untracked([meta["control"]])[0])
            named = ShmBucketStream(buckets, entries, self._fp8rl_shm_ctl[1].buf, int(meta["seq"]),
                                    float(meta.get("timeout_s") or 600.0))
        else:
            named = unpack_buckets(buckets, entries)
        out = self._fp8rl_guarded(named, kv_scales, version)
        del named, buckets
        return out

    def _fp8rl_load_ring(self, meta: dict, kv_scales: dict, version: int) -> int:
        names = (meta["ring"], meta["control"])
        cached = getattr(self, "_fp8rl_shm_ring", None)
        if cached is None or cached[0] != names:
            self.fp8rl_release_shm()
            self._fp8rl_shm_ring = (names, _attach_untracked(names))
        ring, ctl = self._fp8rl_shm_ring[1]
        layout = (meta.get("layout"), int(meta["slot_bytes"]))
        cached = getattr(self, "_fp8rl_ring_layout", None)
        if layout[0] is None or cached is None or cached[0] != layout:  # the sender names each layout it plans
            entries = [TensorEntry(*e) for e in meta["entries"]]
            cached = self._fp8rl_ring_layout = (layout, entries, ring_pieces(entries, layout[1]))
        stream = ShmRingStream(ring.buf, layout[1], int(meta["slots"]), cached[1], ctl.buf, int(meta["seq"]),
                               int(meta["reader"]), float(meta.get("timeout_s") or 600.0), pieces=cached[2])
        try:
            out = self._fp8rl_guarded(stream, kv_scales, version)
        finally:
            stream.finish()  # a load that stopped early tells the sender at once (it never waits on a ring slot)
        del stream
        return out

    def fp8rl_release_shm(self) -> None:
        """Unmap the shared-memory segments of the last sync (the sender owns and unlinks them)."""
        cached = getattr(self, "_fp8rl_shm", None)
        ctl = getattr(self, "_fp8rl_shm_ctl", None)
        ring = getattr(self, "_fp8rl_shm_ring", None)
        self._fp8rl_shm = self._fp8rl_shm_ctl = self._fp8rl_shm_ring = None
        for s in ((cached[1] if cached else []) + ([ctl[1]] if ctl and ctl[1] is not None else [])
                  + (list(ring[1]) if ring else [])):
            try:
                s.close()
            except BufferError:  # a view is still referenced somewhere; dropped with it
                pass

    def fp8rl_load_cuda_ipc(self, meta: dict, kv_scales: dict, version: int) -> int:
        """CUDA IPC transport: view the sender's device buckets (opened from their IPC handles once per bucket
        set, see :meth:`_fp8rl_ipc_buckets`) and load from them."""
        import torch

        buckets = self._fp8rl_ipc_buckets(meta, torch.cuda.current_device())
        named = unpack_buckets(buckets, [TensorEntry(*e) for e in meta["entries"]])
        out = self._fp8rl_guarded(named, kv_scales, version)
        torch.cuda.synchronize()
        return out

    def _fp8rl_ipc_buckets(self, meta: dict, device_index: int) -> list:
        """The sender's buckets as tensors on ``device_index``, rebuilt from ``meta["handles"]`` (``(rebuild_fn,
        args)`` pairs of ``torch.multiprocessing.reductions.reduce_tensor``) only when ``meta["buckets_id"]``
        names a bucket set this receiver has not opened yet: the sender keeps its buckets across syncs, so a
        steady-state sync opens no IPC handle."""
        bid = meta.get("buckets_id")
        cached = getattr(self, "_fp8rl_ipc", None)
        if bid is not None and cached is not None and cached[0] == bid:
            return cached[1]
        buckets = []
        for fn, args in meta["handles"]:
            args = list(args)
            args[6] = device_index  # the handle names the sender's device index; map it to ours (same GPU)
            buckets.append(fn(*args))
        self._fp8rl_ipc = (bid, buckets) if bid is not None else None
        return buckets

    def fp8rl_join_group(self, host: str, port: int, world_size: int, rank_offset: int, backend: str,
                         timeout_s: float) -> int:
        """Join the trainer's stateless broadcast group (rank ``rank_offset`` + this worker's rank)."""
        rank = int(rank_offset) + int(getattr(self, "rank", 0) or 0)
        self._fp8rl_group = _make_group(host, port, world_size, rank, backend, timeout_s)
        return rank

    def fp8rl_load_broadcast(self, meta: dict, kv_scales: dict, version: int) -> int:
        """``torch.distributed`` transport: receive the broadcast buckets from rank 0, then load."""
        import torch

        if self._fp8rl_group is None:
            raise RuntimeError("fp8rl_load_broadcast before fp8rl_join_group")
        device = "cuda" if meta["backend"] == "nccl" else "cpu"
        if meta.get("stream"):
            stream = BucketStream(self._fp8rl_group, meta["sizes"], [TensorEntry(*e) for e in meta["entries"]],
                                  device)
            try:
                return self._fp8rl_guarded(stream, kv_scales, version)
            finally:
                stream.drain()  # a load that stopped early (an error) still takes every bucket: the sender never hangs
        key = (tuple(meta["sizes"]), device)
        cached = getattr(self, "_fp8rl_bcast", None)
        if cached is None or cached[0] != key:  # reused every step while the layout is unchanged
            cached = self._fp8rl_bcast = (key, [torch.empty(n, dtype=torch.uint8, device=device) for n in key[0]])
        buckets = cached[1]
        for b in buckets:
            _broadcast(self._fp8rl_group, b)
        named = unpack_buckets(buckets, [TensorEntry(*e) for e in meta["entries"]])
        return self._fp8rl_guarded(named, kv_scales, version)


class BucketStream:
    """Receive broadcast buckets one at a time and yield ``(name, tensor)`` views as each bucket lands.

    Each bucket is received into its own fresh allocation, and the yielded tensors are views into it, so a loader
    that keeps tensors until their module is complete (vLLM's layerwise reload buffers a module's shards) stays
    correct, and a bucket's memory is freed once the loader drops its views: the receiver holds about one bucket
    beyond its parameters instead of the whole payload. Used by :class:`TorchDistributedTransport` with
    ``stream=True``.

    Args:
      group: the ``torch.distributed`` group (rank 0 broadcasts).
      sizes: byte size of each bucket, in broadcast order.
      entries: :class:`TensorEntry` of every tensor (``bucket`` = index into ``sizes``).
      device: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL).
    """

    def __init__(self, group, sizes: Sequence[int], entries: Sequence[TensorEntry], device: str):
        self.group, self.sizes, self.device = group, [int(n) for n in sizes], device
        self.by_bucket = entries_by_bucket(entries, len(self.sizes))
        self.received = 0

    def __iter__(self):
        import torch

        while self.received < len(self.sizes):
            k = self.received
            bucket = torch.empty(self.sizes[k], dtype=torch.uint8, device=self.device)
            _broadcast(self.group, bucket)
            self.received += 1
            yield from unpack_buckets({k: bucket}, self.by_bucket[k])
            del bucket

    def drain(self) -> None:
        """Receive (and drop) the buckets the loader did not ask for, so the sender's broadcasts complete."""
        import torch

        if self.received < len(self.sizes):
            scratch = torch.empty(max(self.sizes[self.received:]), dtype=torch.uint8, device=self.device)
            while self.received < len(self.sizes):
                _broadcast(self.group, scratch[:self.sizes[self.received]])
                self.received += 1


class ShmBucketStream:
    """Yield ``(name, tensor)`` views into shared-memory buckets as the sender marks each bucket complete.

    The sender (:class:`SharedMemoryTransport` with ``stream=True``) starts the receiver's load first, then fills
    the buckets in order and after each one stores ``k + 1`` in the control word ``ready``; this reader waits for
    ``ready > k`` before handing out bucket ``k``'s tensors, so the receiver's copy of bucket ``k`` overlaps the
    sender's fill of bucket ``k + 1``. The control block is two int64 words ``[seq, ready]`` in its own segment:
    ``seq`` is the sender's sync counter (the reader refuses buckets of another sync: a reader can never see a
    half-written or an older step), ``ready = -1`` means the sender gave up (the load fails at once).
    Ordering: the bucket bytes are stored before the counter (program order; x86-64 keeps stores in order, and
    glibc's ``memcpy`` fences its non-temporal stores), and read after it.

    Args:
      buckets: uint8 tensors over the segments, by bucket index. entries: every tensor's :class:`TensorEntry`.
      control: the control segment's buffer (16 bytes). seq: the sync counter this load belongs to.
      timeout_s: seconds to wait for one bucket before raising ``TimeoutError``.
    """

    def __init__(self, buckets, entries: Sequence[TensorEntry], control, seq: int, timeout_s: float = 600.0):
        import numpy as np

        self.buckets, self.seq, self.timeout_s = buckets, int(seq), float(timeout_s)
        self.by_bucket = entries_by_bucket(entries, len(buckets))
        self.ctl = np.ndarray((2,), np.int64, buffer=control)

    def _wait(self, k: int) -> None:
        deadline, spins = time.monotonic() + self.timeout_s, 0
        while True:
            seq, ready = int(self.ctl[0]), int(self.ctl[1])
            if seq == self.seq and ready > k:
                return
            if seq == self.seq and ready < 0:
                raise WeightSyncError(f"sender aborted shared-memory sync {self.seq} before bucket {k}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"bucket {k} of shared-memory sync {self.seq} not ready after {self.timeout_s}s "
                                   f"(control: seq {seq}, ready {ready})")
            spins += 1
            time.sleep(0 if spins < 100 else 50e-6)

    def __iter__(self):
        for k, members in enumerate(self.by_bucket):
            self._wait(k)
            yield from unpack_buckets(self.buckets, members)


def ring_pieces(entries: Sequence[TensorEntry], slot_bytes: int) -> list[list[tuple[int, int, int, int]]]:
    """Cut a payload laid out in one byte stream (``entries``' offsets; one bucket) into ring chunks of
    ``slot_bytes``: ``[chunk] -> [(entry index, offset in the tensor, offset in the slot, nbytes)]``."""
    total = max((e.offset + e.nbytes for e in entries), default=0)
    out: list[list[tuple[int, int, int, int]]] = [[] for _ in range(max(1, -(-total // slot_bytes)))]
    for j, e in enumerate(entries):
        p = 0
        while p < e.nbytes:
            c, so = divmod(e.offset + p, slot_bytes)
            n = min(e.nbytes - p, slot_bytes - so)
            out[c].append((j, p, so, n))
            p += n
    return out


_SPIN_S = 50e-6  # a ring slot is copied in ~25 us on the benchmark machine: waits that long are spun


def _pause(spins: int, waited_s: float) -> None:
    """Back-off of a shared-memory wait (``waited_s`` is read every 32 spins): spin while the other side is
    probably copying, then sleep in short steps, which leaves the core to the other side when the two processes
    share one (a busy host): a spinning or yielding waiter still takes its share of that core."""
    if waited_s >= _SPIN_S:
        time.sleep(20e-6)


class ShmRingStream:
    """Read a payload that the sender streams through a small shared-memory ring of ``slots`` x ``slot_bytes``.

    Why a ring: through payload-sized segments the receiver reads bytes the sender wrote long before, so each of
    the two copies streams the whole payload through DRAM, and on the 2-core benchmark machine running them
    concurrently (streamed buckets) was no faster than one after the other. Through a ring the receiver empties
    right behind the sender, the middle hop stays in the caches: DRAM sees the source read and the destination
    write, what one direct copy costs, and each process copies on its own core. The sender keeps at most ``lead``
    chunks (1 MiB by default: the cores' L2 there) ahead of readers that keep pace and fills up to the whole ring
    only when a reader stalls (not running on a busy host), so the two processes switch less often then.

    Protocol (control block of int64 words ``[seq, ready, consumed_0, consumed_1, ...]``): the sender fills chunk
    ``c`` into slot ``c % slots`` once every reader has consumed chunk ``c - slots`` and then stores ``ready = c +
    1`` (``-1``: the sender gave up); reader ``r`` copies chunk ``c`` out once ``ready > c`` and then stores
    ``consumed_r = seq << 32 | (c + 1)`` (``-seq``: this reader stopped; the sender fails at once instead of
    waiting). ``seq`` is the sender's sync counter: a reader never takes another sync's chunks, and the sender never
    counts a word left by another sync's reader. Ordering as in :class:`ShmBucketStream` (x86-64 keeps stores in
    order; glibc fences its non-temporal stores).

    A receiver that copies into its own memory calls :meth:`copy_into` (no view of the ring escapes). Iterating
    yields ``(name, tensor)`` as each tensor is complete, each in a fresh tensor the consumer may keep (a slot is
    refilled once consumed).

    Args:
      ring: the ring segment's buffer. slot_bytes, slots: ring geometry. entries: the tensors' layout in one byte
      stream (:func:`plan_buckets` with one bucket). control: the control segment's buffer. seq: this sync's
      counter. reader: this reader's index (its ``consumed`` word). timeout_s: seconds to wait for one chunk.
    """

    def __init__(self, ring, slot_bytes: int, slots: int, entries: Sequence[TensorEntry], control, seq: int,
                 reader: int, timeout_s: float = 600.0, pieces=None):
        import numpy as np

        self.slot_bytes, self.slots, self.seq, self.reader = int(slot_bytes), int(slots), int(seq), int(reader)
        self.timeout_s = float(timeout_s)
        self.ring = np.frombuffer(ring, np.uint8, count=self.slot_bytes * self.slots)
        self.entries = list(entries)
        self.pieces = pieces if pieces is not None else ring_pieces(self.entries, self.slot_bytes)
        self.ctl = np.ndarray((3 + self.reader,), np.int64, buffer=control)
        self.consumed = 0

    def _wait(self, c: int) -> None:
        ctl, want = self.ctl, self.seq
        if ctl[1] > c and ctl[0] == want:
            return
        t0, spins, waited = time.perf_counter(), 0, 0.0
        while True:
            seq, ready = int(ctl[0]), int(ctl[1])
            if seq == want and ready > c:
                return
            if seq == want and ready < 0:
                raise WeightSyncError(f"sender aborted shared-memory sync {self.seq} before ring chunk {c}")
            spins += 1
            if spins % 32 == 0:
                waited = time.perf_counter() - t0
                if waited > self.timeout_s:
                    raise TimeoutError(f"ring chunk {c} of shared-memory sync {self.seq} not ready after "
                                       f"{self.timeout_s}s (control: seq {seq}, ready {ready})")
            _pause(spins, waited)

    def _chunks(self, dsts):
        """Copy every chunk's pieces into ``dsts[entry index]`` (flat uint8 numpy arrays, or None: allocated by
        ``alloc``) in order, yielding after each chunk is consumed."""
        import numpy as np

        ring, slot = self.ring, self.slot_bytes
        for c, pieces in enumerate(self.pieces):
            self._wait(c)
            base = (c % self.slots) * slot
            for j, toff, so, n in pieces:
                np.copyto(dsts[j][toff:toff + n], ring[base + so:base + so + n])
            self.consumed = c + 1
            self.ctl[2 + self.reader] = (self.seq << 32) | (c + 1)
            yield c

    def copy_into(self, dsts: Sequence[Any]) -> None:
        """Copy the payload into ``dsts`` (flat uint8 CPU tensors or arrays, one per entry, in entry order).

        Raises:
          ValueError: a destination whose byte length differs from its entry (named).
          WeightSyncError: the sender aborted. TimeoutError: a chunk did not come within ``timeout_s``.
        """
        arrs = []
        for e, d in zip(self.entries, dsts, strict=True):
            a = d.numpy() if hasattr(d, "numpy") else d
            if a.size != e.nbytes:
                raise ValueError(f"{e.name}: destination has {a.size} bytes, the sync sends {e.nbytes}")
            arrs.append(a)
        for _ in self._chunks(arrs):
            pass

    def __iter__(self):
        import torch

        last = [min((e.offset + max(e.nbytes, 1) - 1) // self.slot_bytes, len(self.pieces) - 1) for e in self.entries]
        done_at: list[list[int]] = [[] for _ in self.pieces]
        for j, c in enumerate(last):
            done_at[c].append(j)
        out = [torch.empty(e.nbytes, dtype=torch.uint8) for e in self.entries]
        arrs = [t.numpy() for t in out]
        for c in self._chunks(arrs):
            for j in done_at[c]:
                e = self.entries[j]
                yield e.name, out[j].view(getattr(torch, e.dtype)).reshape(e.shape)
                out[j] = arrs[j] = None

    def finish(self) -> None:
        """Tell the sender this reader stops here if it did not consume every chunk (idempotent)."""
        if self.consumed < len(self.pieces):
            self.ctl[2 + self.reader] = -self.seq


def _attach_untracked(names: Sequence[str]) -> list:
    """Attach existing shared-memory segments without registering them with a resource tracker.

    Python < 3.13 registers attached segments too, so a receiver's tracker would unlink the sender's segment when
    the receiver exits (and a tracker shared with the sender would lose the sender's registration). The sender
    owns and unlinks the segments (``track=False`` semantics of Python 3.13).
    """
    from multiprocessing import resource_tracker, shared_memory

    register = resource_tracker.register
    resource_tracker.register = lambda *a, **k: None
    try:
        return [shared_memory.SharedMemory(name=n) for n in names]
    finally:
        resource_tracker.register = register


def _make_group(host: str, port: int, world_size: int, rank: int, backend: str, timeout_s: float):
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, int(port), int(world_size), rank == 0, timeout=timeout)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, world_size)
    raise ValueError(f"unknown torch.distributed backend {backend!r}; expected 'gloo' or 'nccl'")


def _broadcast(group, tensor) -> None:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([tensor], opts).wait()


def broadcast_streamed(group, tensors: dict[str, Any], entries: Sequence[TensorEntry], sizes: Sequence[int],
                       buf=None, device: str = "cpu"):
    """Broadcast the buckets of :func:`plan_buckets` from rank 0 one at a time through one reused buffer: each
    bucket is filled, then broadcast, and the broadcast completes before the next fill (the receivers take them
    with :class:`BucketStream`).

    Args:
      group: a stateless group from :func:`_make_group` (rank 0 = this process).
      tensors, entries, sizes: the payload and its bucket plan.
      buf: the uint8 buffer of the previous call (reused when it holds the largest bucket), or None.
      device: where a new buffer is allocated (``"cpu"`` for gloo, ``"cuda"`` for NCCL).

    Returns:
      the buffer used (pass it to the next call).
    """
    import torch

    if buf is None or buf.numel() < max(sizes):
        buf = torch.empty(max(sizes), dtype=torch.uint8, device=device)
    for k, (n, members) in enumerate(zip(sizes, entries_by_bucket(entries, len(sizes)))):
        view = buf[:n]
        fill_buckets({k: view}, tensors, members)
        _broadcast(group, view)
    return buf


# ---------------------------------------------------------------------------------------------------------------
# sender side
# ---------------------------------------------------------------------------------------------------------------
class Pending(Protocol):
    """A started receiver call; ``result(timeout)`` returns its value or raises."""

    def result(self, timeout: float | None = None) -> Any: ...


class Receiver(Protocol):
    """A handle the sender calls receiver methods through (vLLM ``collective_rpc``, a Ray actor, ...)."""

    name: str

    def call(self, method: str, *args) -> Pending:
        """Start ``method(*args)`` on the receiver (all of its workers) and return at once."""


class ThreadReceiver:
    """A :class:`Receiver` over a blocking ``rpc(method, args) -> value`` callable, run on a helper thread
    (used for the in-process vLLM engine: ``llm.collective_rpc``)."""

    def __init__(self, rpc: Callable[[str, tuple], Any], name: str = "local"):
        self.rpc, self.name = rpc, name
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"fp8rl-{name}")

    def call(self, method: str, *args) -> Pending:
        """Start ``rpc(method, args)`` on the helper thread."""
        return self._pool.submit(self.rpc, method, args)


def _serve_receiver(conn, factory) -> None:
    """Child-process loop of :class:`ProcessReceiver`: build the receiver, then ``(method, args)`` in, result out."""
    rec = factory()
    while True:
        msg = conn.recv()
        if msg is None:
            return
        method, args = msg
        try:
            conn.send(("ok", getattr(rec, method)(*args)))
        except Exception as e:  # noqa: BLE001 - reported to the caller, which raises it as a failed call
            conn.send(("err", f"{type(e).__name__}: {e}"))


class _PipePending:
    def __init__(self, conn):
        self.conn = conn

    def done(self) -> bool:
        return bool(self.conn.poll(0))

    def result(self, timeout: float | None = None):
        if not self.conn.poll(timeout):
            raise TimeoutError("receiver process did not answer")
        status, val = self.conn.recv()
        if status != "ok":
            raise RuntimeError(val)
        return val


class ProcessReceiver:
    """A :class:`Receiver` in a spawned process, reached over a pipe (one call in flight at a time): the shape of a
    vLLM worker's RPC, without vLLM (benchmarks and cross-process tests).

    Args:
      factory: picklable zero-argument callable run in the child to build the receiver object (e.g. a
        :class:`WeightReceiverMixin` subclass defined at module level).
      name: the name used in sync errors.
    """

    def __init__(self, factory: Callable[[], Any], name: str = "receiver-process"):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.name = name
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve_receiver, args=(child, factory), daemon=True)
        self.proc.start()

    def call(self, method: str, *args) -> Pending:
        """Send ``method(*args)`` to the child; the result comes with ``.result(timeout)``."""
        self.conn.send((method, args))
        return _PipePending(self.conn)

    def close(self) -> None:
        """Stop the child process."""
        self.conn.send(None)
        self.proc.join(30)


def _wait_all(receivers: Sequence[Receiver], pendings: Sequence[Pending], what: str, timeout_s: float | None,
              version: int) -> None:
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    for r, p in zip(receivers, pendings):
        left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        try:
            got = p.result(timeout=left)
        except WeightSyncError:
            raise
        except (concurrent.futures.TimeoutError, TimeoutError) as e:
            raise WeightSyncError(f"weight sync v{version} to {r.name} timed out after {timeout_s}s during {what}") from e
        except Exception as e:  # noqa: BLE001 - any receiver failure is a failed sync, named and chained
            raise WeightSyncError(f"weight sync v{version} to {r.name} failed during {what}: "
                                  f"{type(e).__name__}: {e}") from e
        vals = got if isinstance(got, (list, tuple)) else [got]
        if what.startswith("load") and any(int(v) != int(version) for v in vals):
            raise WeightSyncError(f"receiver {r.name} reports weights version {vals} after sync v{version}")


@dataclasses.dataclass
class SyncStats:
    """What one sync moved: ``nbytes`` (payload bytes), ``seconds`` (wall), ``transport`` name, ``buckets``."""

    transport: str
    nbytes: int
    seconds: float
    buckets: int = 0

    @property
    def gb_per_s(self) -> float:
        """Achieved bandwidth of the sync, payload GB (1e9 bytes) per wall second (0.0 for an instant sync)."""
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class Transport:
    """Base class: ``send(tensors, kv_scales, version, receivers, timeout_s) -> SyncStats``.

    ``tensors`` are torch tensors (DLPack views of the trainer's JAX arrays), ordered by layer.
    """

    name = "base"

    def send(self, tensors: dict[str, Any], kv_scales: dict, version: int, receivers: Sequence[Receiver],
             timeout_s: float | None = None) -> SyncStats:
        """Deliver one complete set of weights to every receiver; raise :class:`WeightSyncError` on failure."""
        raise NotImplementedError

    def close(self) -> None:
        """Release buffers / groups."""


def _payload_bytes(tensors: dict[str, Any]) -> int:
    return int(sum(int(t.numel()) * int(t.element_size()) for t in tensors.values()))


class InProcessTransport(Transport):
    """Hand the tensors themselves to receivers living in this process (no serialization, no copy)."""

    name = "inprocess"

    def send(self, tensors, kv_scales, version, receivers, timeout_s=None) -> SyncStats:
        """See :class:`Transport`."""
        t0 = time.perf_counter()
        named = list(tensors.items())
        pend = [r.call("fp8rl_load_tensors", named, kv_scales, version) for r in receivers]
        _wait_all(receivers, pend, "load (in-process)", timeout_s, version)
        return SyncStats(self.name, _payload_bytes(tensors), time.perf_counter() - t0, 0)


class SharedMemoryTransport(Transport):
    """Flattened buckets in POSIX shared memory (CPU tensors) or CUDA IPC buffers (CUDA tensors).

    Args:
      bucket_bytes: bucket capacity (default: 512 MiB, or 64 MiB when streaming on CPU). The CPU segments are
        created once and reused while the layout is unchanged (a steady-state sync is one memcpy per tensor plus
        the receiver's load).
      stream: CPU only. ``True`` (default): the receiver's load starts first and reads what the sender has
        filled so far, so the sender's fill and the receiver's copy overlap: through a ring (below) where the
        receivers allow it, else bucket ``k`` as soon as the sender has filled it (:class:`ShmBucketStream`; a
        control word in shared memory, no extra RPC); ``False``: fill everything, then load.
      ring: streamed CPU sends only. ``None`` (default): stream through a ``ring_slots`` x ``ring_slot_bytes`` ring
        (:class:`ShmRingStream`: the payload passes through the L3 cache instead of DRAM between the two copies)
        when every receiver answers ``fp8rl_shm_ring_reader() is True`` (asked once per receiver set: receivers
        that copy into their own memory, e.g. :class:`rollout_bridge.torch_receiver.TorchParamsReceiver`; a
        receiver with several workers answers a list and keeps the payload-sized buckets, whose views a loader
        like vLLM's layerwise reload may keep); ``True``: always (one reader per receiver; other consumers get
        fresh tensors); ``False``: never.
      ring_slot_bytes, ring_slots, ring_lead: ring geometry: ``ring_slots`` chunks of ``ring_slot_bytes``; the sender
        stays within ``ring_lead`` chunks of readers that keep pace (default 32 x 512 KiB, lead 2: 1 MiB, the L2 of
        a core of the benchmark machine) and uses the whole ring only when a reader stalls.

    Attributes:
      last_buckets: buckets (ring: chunks) used by the last :meth:`send`.
      last_mode: ``"ring"``, ``"stream"``, ``"unstreamed"`` or ``"cuda_ipc"``: how the last :meth:`send` went.
    """

    name = "shm"

    def __init__(self, bucket_bytes: int | None = None, stream: bool = True, ring: bool | None = None,
                 ring_slot_bytes: int = RING_SLOT_BYTES, ring_slots: int = RING_SLOTS, ring_lead: int = RING_LEAD):
        self.stream = bool(stream)
        self.bucket_bytes = int(bucket_bytes or (STREAM_BUCKET_BYTES if self.stream else DEFAULT_BUCKET_BYTES))
        self.ring = ring
        self.ring_slot_bytes, self.ring_slots, self.ring_lead = int(ring_slot_bytes), int(ring_slots), int(ring_lead)
        if self.ring_slot_bytes <= 0 or self.ring_slot_bytes % ALIGN or self.ring_slots < 1 or self.ring_lead < 1:
            raise ValueError(f"ring geometry {self.ring_slots} x {self.ring_slot_bytes} bytes, lead {self.ring_lead}: "
                             f"need >= 1 slot of a positive multiple of {ALIGN} bytes and a lead >= 1")
        self._segs: list = []
        self._sizes: list[int] = []
        self._ctl = None
        self._ring_segs = None  # (readers, ring segment, control segment)
        self._ring_ok: tuple | None = None  # (receivers, whether all of them read rings)
        self._ring_layout = None  # (layout key, entries, their tuples, ring pieces, layout id)
        self._seq = 0
        self._cuda = None  # (layout key, device buckets, their IPC handles, bucket-set id)
        self.last_buckets = 0
        self.last_mode = ""

    def _segments(self, sizes: list[int]):
        import torch
        from multiprocessing import shared_memory

        if sizes != self._sizes:
            self.close()
            tag = uuid.uuid4().hex[:12]
            self._segs = [shared_memory.SharedMemory(create=True, size=s, name=f"fp8rl_{tag}_{i}")
                          for i, s in enumerate(sizes)]
            self._ctl = shared_memory.SharedMemory(create=True, size=16, name=f"fp8rl_{tag}_ctl")
            self._sizes = list(sizes)
        return [torch.frombuffer(s.buf, dtype=torch.uint8, count=n) for s, n in zip(self._segs, sizes)]

    def send(self, tensors, kv_scales, version, receivers, timeout_s=None) -> SyncStats:
        """See :class:`Transport`."""
        import numpy as np
        import torch

        t0 = time.perf_counter()
        entries, sizes = plan_buckets(tensors, self.bucket_bytes)
        flat = [dataclasses.astuple(e) for e in entries]
        on_cuda = any(t.is_cuda for t in tensors.values())
        self.last_buckets = len(sizes)
        if on_cuda:
            from torch.multiprocessing.reductions import reduce_tensor

            dev = next(t.device for t in tensors.values() if t.is_cuda)
            key = (tuple(sizes), str(dev))
            if self._cuda is None or self._cuda[0] != key:  # persistent: allocated and shared once per layout
                buckets = [torch.empty(s, dtype=torch.uint8, device=dev) for s in sizes]
                self._cuda = (key, buckets, [reduce_tensor(b) for b in buckets], uuid.uuid4().hex)
            _, buckets, handles, bid = self._cuda
            self.last_mode = "cuda_ipc"
            fill_buckets(buckets, tensors, entries)  # the previous sync's loads have all returned
            torch.cuda.synchronize(dev)
            meta = {"entries": flat, "handles": handles, "buckets_id": bid}
            pend = [r.call("fp8rl_load_cuda_ipc", meta, kv_scales, version) for r in receivers]
            _wait_all(receivers, pend, "load (CUDA IPC)", timeout_s, version)
            del buckets
        elif self.stream and self._use_ring(receivers, timeout_s):
            return self._send_ring(tensors, kv_scales, version, receivers, timeout_s, t0)
        elif self.stream:
            self.last_mode = "stream"
            buckets = self._segments(sizes)
            ctl = np.ndarray((2,), np.int64, buffer=self._ctl.buf)
            self._seq += 1
            ctl[1] = 0  # nothing ready; then name the sync the buckets now belong to
            ctl[0] = self._seq
            meta = {"entries": flat, "segments": [s.name for s in self._segs], "sizes": sizes,
                    "control": self._ctl.name, "seq": self._seq, "timeout_s": timeout_s}
            pend = [r.call("fp8rl_load_shm", meta, kv_scales, version) for r in receivers]
            try:
                by_bucket = entries_by_bucket(entries, len(sizes))
                for k in range(len(sizes)):
                    fill_buckets(buckets, tensors, by_bucket[k])
                    ctl[1] = k + 1
            except BaseException:
                ctl[1] = -1  # the readers fail now instead of at their timeout
                raise
            finally:
                del buckets, ctl
            _wait_all(receivers, pend, "load (shared memory, streamed)", timeout_s, version)
        else:
            self.last_mode = "unstreamed"
            buckets = self._segments(sizes)
            fill_buckets(buckets, tensors, entries)
            del buckets
            meta = {"entries": flat, "segments": [s.name for s in self._segs], "sizes": sizes}
            pend = [r.call("fp8rl_load_shm", meta, kv_scales, version) for r in receivers]
            _wait_all(receivers, pend, "load (shared memory)", timeout_s, version)
        return SyncStats(self.name, _payload_bytes(tensors), time.perf_counter() - t0, len(sizes))

    def _use_ring(self, receivers, timeout_s) -> bool:
        if self.ring is not None:
            return bool(self.ring)
        key = tuple(receivers)
        if self._ring_ok is None or self._ring_ok[0] != key:
            ok = bool(receivers)
            pend = [r.call("fp8rl_shm_ring_reader") for r in receivers]
            for p in pend:
                try:
                    ok = ok and p.result(timeout=min(timeout_s or 60.0, 60.0)) is True  # a list: several workers
                except Exception:  # noqa: BLE001 - a receiver without the method reads payload-sized buckets
                    ok = False
            self._ring_ok = (key, ok)
        return self._ring_ok[1]

    def _ring(self, readers: int):
        from multiprocessing import shared_memory

        if self._ring_segs is None or self._ring_segs[0] != readers:
            self._close_ring()
            tag = uuid.uuid4().hex[:12]
            ring = shared_memory.SharedMemory(create=True, size=self.ring_slot_bytes * self.ring_slots,
                                              name=f"fp8rl_{tag}_ring")
            ctl = shared_memory.SharedMemory(create=True, size=8 * (2 + readers), name=f"fp8rl_{tag}_ringctl")
            self._ring_segs = (readers, ring, ctl)
        return self._ring_segs[1], self._ring_segs[2]

    def _send_ring(self, tensors, kv_scales, version, receivers, timeout_s, t0) -> SyncStats:
        """Streamed CPU send through the ring (:class:`ShmRingStream`): fill chunk ``c`` once every reader has
        consumed chunk ``c - lead`` (or, for a reader that stalls, ``c - slots``), publish ``ready = c + 1``."""
        import numpy as np

        slot, slots = self.ring_slot_bytes, self.ring_slots
        key = (slot, tuple((k, t.dtype, t.shape) for k, t in tensors.items()))
        if self._ring_layout is None or self._ring_layout[0] != key:  # planned once per layout
            entries, _ = plan_buckets(tensors, 1 << 62)  # one byte stream: offsets of every tensor in it
            self._ring_layout = (key, entries, [dataclasses.astuple(e) for e in entries], ring_pieces(entries, slot),
                                 uuid.uuid4().hex)
        _, entries, flat, pieces, layout = self._ring_layout
        ring_seg, ctl_seg = self._ring(len(receivers))
        ring = np.frombuffer(ring_seg.buf, np.uint8, count=slot * slots)
        ctl = np.ndarray((2 + len(receivers),), np.int64, buffer=ctl_seg.buf)
        self._seq += 1
        seq = self._seq
        ctl[1] = 0  # nothing ready, nothing consumed; then name the sync the ring now belongs to
        ctl[2:] = 0
        ctl[0] = seq
        self.last_mode, self.last_buckets = "ring", len(pieces)
        meta = {"entries": flat, "layout": layout, "ring": ring_seg.name, "control": ctl_seg.name,
                "slot_bytes": slot, "slots": slots, "seq": seq, "timeout_s": timeout_s}
        pend = [r.call("fp8rl_load_shm", dict(meta, reader=i), kv_scales, version) for i, r in enumerate(receivers)]
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        lead, close, srcs = min(self.ring_lead, slots), True, None
        try:
            srcs = [_as_bytes(tensors[e.name]).numpy() for e in entries]  # while the receivers set up their loads
            for c, ps in enumerate(pieces):
                if c >= lead:
                    need = c - lead + 1
                    if close:  # keep within `lead` chunks of readers that keep pace (a short spin) ...
                        close = self._wait_consumed(ctl, seq, need, receivers, pend, deadline, version, _SPIN_S)
                    elif all(int(v) >= (seq << 32) | need for v in ctl[2:]):  # ... they caught up
                        close = True
                    if not close and c >= slots and not all(int(v) >= (seq << 32) | (c - slots + 1) for v in ctl[2:]):
                        # a reader that fell a whole ring behind (not running: a busy host): wait until it is
                        # within `lead` again, so the two then run close together instead of a ring apart
                        close = self._wait_consumed(ctl, seq, need, receivers, pend, deadline, version)
                base = (c % slots) * slot
                for j, toff, so, n in ps:
                    np.copyto(ring[base + so:base + so + n], srcs[j][toff:toff + n])
                ctl[1] = c + 1
        except BaseException:
            ctl[1] = -1  # the readers fail now instead of at their timeout
            raise
        finally:
            del ring, ctl, srcs
        _wait_all(receivers, pend, "load (shared memory, ring)", timeout_s, version)
        return SyncStats(self.name, _payload_bytes(tensors), time.perf_counter() - t0, len(pieces))

    @staticmethod
    def _wait_consumed(ctl, seq: int, need: int, receivers, pend, deadline, version: int,
                       soft_s: float | None = None) -> bool:
        """Wait until every reader has consumed ``need`` chunks (``True``), or, with ``soft_s``, give up after
        ``soft_s`` seconds (``False``); a reader that stopped (its word ``-seq``, or its call returned) fails the
        sync with the receiver's own error, a silent one at ``deadline``."""
        t0, spins, waited, want = None, 0, 0.0, (seq << 32) | need
        for i, r in enumerate(receivers):
            word = 2 + i
            while True:
                v = int(ctl[word])
                if v >= want and v >> 32 == seq:
                    break
                if t0 is None:
                    t0 = time.perf_counter()
                spins += 1
                stopped = v == -seq
                if not stopped and spins % 32 == 0:
                    waited = time.perf_counter() - t0
                    done = getattr(pend[i], "done", None)
                    stopped = bool(spins % 1024 == 0 and done is not None and done())
                if stopped:
                    _wait_all([r], [pend[i]], "load (shared memory, ring)", 60.0, version)
                    raise WeightSyncError(f"receiver {r.name} stopped reading weights v{version} after "
                                          f"{v & 0xFFFFFFFF if v > 0 else 0} ring chunks")
                if soft_s is not None and waited > soft_s:
                    return False
                if spins % 32 == 0 and deadline is not None and time.monotonic() > deadline:
                    raise WeightSyncError(f"weight sync v{version} to {r.name} timed out: ring chunk {need - 1} "
                                          "not consumed")
                _pause(spins, waited)
        return True

    def _close_ring(self) -> None:
        segs, self._ring_segs = self._ring_segs, None
        _release_segments(segs[1:] if segs else ())

    def close(self) -> None:
        """Unlink the shared-memory segments and drop the CUDA IPC buckets."""
        self._cuda = None
        self._close_ring()
        self._ring_ok = None
        _release_segments(self._segs + ([self._ctl] if self._ctl is not None else []))
        self._segs, self._sizes, self._ctl = [], [], None


def _release_segments(segments) -> None:
    """Close and unlink shared-memory segments (a segment still viewed stays mapped until the views go; an already
    unlinked one is skipped)."""
    for s in segments:
        try:
            s.close()
        except BufferError:
            pass
        try:
            s.unlink()
        except FileNotFoundError:
            pass


def free_port(host: str = "127.0.0.1") -> int:
    """An unused TCP port on ``host`` (for the broadcast group's ``TCPStore``)."""
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class TorchDistributedTransport(Transport):
    """Broadcast flattened buckets over a stateless ``torch.distributed`` group (rank 0 = trainer).

    Args:
      host: address the receivers reach the trainer's ``TCPStore`` at (this node's IP for a cluster).
      port: store port (default: a free one).
      backend: ``"gloo"`` (CPU tensors) or ``"nccl"`` (CUDA tensors).
      bucket_bytes: bucket capacity.
      timeout_s: group timeout (seconds); a receiver that stops answering fails the broadcast after it.
      workers_per_receiver: ranks each receiver contributes (vLLM tensor-parallel size).
      stream: ``True``: one bucket at a time (the sender reuses one ``bucket_bytes`` buffer, the receiver loads
        each bucket as it lands, :class:`BucketStream`), so neither side holds a second copy of the payload;
        ``False``: all buckets are kept allocated on both sides and reused every step (no allocation per sync);
        ``None`` (default): stream when the payload exceeds ``stream_threshold_bytes``.
      stream_threshold_bytes: payload size above which ``stream=None`` streams (default 2 GiB: an 8B FP8 model
        streams, a 0.6B one keeps its buckets).
    """

    name = "dist"

    def __init__(self, host: str = "127.0.0.1", port: int | None = None, backend: str = "gloo",
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout_s: float = 120.0, workers_per_receiver: int = 1,
                 stream: bool | None = None, stream_threshold_bytes: int = 2 << 30):
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"unknown torch.distributed backend {backend!r}; expected 'gloo' or 'nccl'")
        self.host, self.port, self.backend = host, port, backend
        self.stream, self.stream_threshold_bytes = stream, int(stream_threshold_bytes)
        self._stream_buf = None
        self.bucket_bytes, self.timeout_s, self.wpr = int(bucket_bytes), float(timeout_s), int(workers_per_receiver)
        self.group = None
        self._receivers: tuple = ()
        self._buckets = None

    def connect(self, receivers: Sequence[Receiver]) -> None:
        """Form the group with ``receivers`` (each joins with its rank offset); idempotent for the same set.

        Raises:
          WeightSyncError: a receiver did not join within ``timeout_s``.
        """
        if self.group is not None and tuple(receivers) == self._receivers:
            return
        port = self.port or free_port(self.host)
        world = 1 + self.wpr * len(receivers)
        pend = [r.call("fp8rl_join_group", self.host, port, world, 1 + i * self.wpr, self.backend, self.timeout_s)
                for i, r in enumerate(receivers)]
        try:
            self.group = _make_group(self.host, port, world, 0, self.backend, self.timeout_s)
        except Exception as e:  # noqa: BLE001
            raise WeightSyncError(f"torch.distributed group ({self.backend}, {self.host}:{port}, world {world}) "
                                  f"did not form within {self.timeout_s}s: {type(e).__name__}: {e}") from e
        _wait_all(receivers, pend, "join_group", self.timeout_s, -1)
        self._receivers = tuple(receivers)

    def send(self, tensors, kv_scales, version, receivers, timeout_s=None) -> SyncStats:
        """See :class:`Transport` (connects on first use)."""
        import torch

        t0 = time.perf_counter()
        self.connect(receivers)
        entries, sizes = plan_buckets(tensors, self.bucket_bytes)
        stream = self.stream if self.stream is not None else _payload_bytes(tensors) > self.stream_threshold_bytes
        meta = {"entries": [dataclasses.astuple(e) for e in entries], "sizes": sizes, "backend": self.backend,
                "stream": bool(stream)}
        pend = [r.call("fp8rl_load_broadcast", meta, kv_scales, version) for r in receivers]
        device = "cuda" if self.backend == "nccl" else "cpu"
        try:
            if stream:
                self._buckets = None
                self._stream_buf = broadcast_streamed(self.group, tensors, entries, sizes, self._stream_buf, device)
            else:
                self._stream_buf = None
                if self._buckets is None or [b.numel() for b in self._buckets] != sizes:
                    self._buckets = [torch.empty(n, dtype=torch.uint8, device=device) for n in sizes]
                fill_buckets(self._buckets, tensors, entries)
                for bucket in self._buckets:
                    _broadcast(self.group, bucket)
        except Exception as e:  # noqa: BLE001
            self.group = None  # a broken group is never reused
            raise WeightSyncError(f"broadcast of weights v{version} failed ({self.backend}): "
                                  f"{type(e).__name__}: {e}") from e
        _wait_all(receivers, pend, "load (broadcast)", timeout_s or self.timeout_s, version)
        return SyncStats(self.name, _payload_bytes(tensors), time.perf_counter() - t0, len(sizes))

    def close(self) -> None:
        """Drop the group and the bucket buffers."""
        self.group = None
        self._receivers = ()
        self._buckets = None
        self._stream_buf = None


def make_transport(name: str, **kwargs) -> Transport:
    """``"inprocess"`` | ``"shm"`` | ``"dist"`` -> a transport (kwargs go to its constructor).

    Raises:
      ValueError: unknown name.
    """
    classes = {"inprocess": InProcessTransport, "shm": SharedMemoryTransport, "dist": TorchDistributedTransport}
    if name not in classes:
        raise ValueError(f"unknown weight-sync transport {name!r}; expected one of {TRANSPORTS}")
    return classes[name](**kwargs)


def order_by_layer(names: Iterable[str]) -> list[str]:
    """Names sorted so each decoder layer's tensors are adjacent (vLLM's layerwise reload processes a layer as
    soon as all of its tensors arrived)."""
    import re

    def key(n):
        m = re.match(r"^model\.layers\.(\d+)\.", n)
        return (0 if n.startswith("model.embed") else 1 if m else 2, int(m.group(1)) if m else 0, n)

    return sorted(names, key=key)


__all__ = ["WeightSyncError", "TensorEntry", "plan_buckets", "fill_buckets", "broadcast_streamed", "unpack_buckets",
           "WeightReceiverMixin", "Receiver", "ThreadReceiver", "Transport", "InProcessTransport",
           "SharedMemoryTransport", "ShmBucketStream", "ShmRingStream", "ring_pieces", "TorchDistributedTransport",
           "SyncStats", "make_transport", "free_port", "order_by_layer", "TRANSPORTS"]
