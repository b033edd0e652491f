"""The torch consumer of the weight sync (rollout_bridge.torch_receiver) and the threaded host copies under it.

References: the bytes the sender holds (numpy views of the source tensors), compared byte for byte; the
receiver's own preallocated tensors must be the objects written (in place, no reallocation).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="optional extra: torch (the rollout_bridge side)")

from rollout_bridge.torch_receiver import TorchParamsReceiver  # noqa: E402
from rollout_bridge.transports import (InProcessTransport, SharedMemoryTransport, ThreadReceiver,  # noqa: E402
                                       WeightReceiverMixin, WeightSyncError, copy_many)


def _bytes(t) -> np.ndarray:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def _tensors(seed: int) -> dict:
    """Sizes on both sides of copy_many's 512 KiB pieces (odd lengths: a short last piece), three dtypes."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(2051, 2049, generator=g).to(torch.bfloat16),  # 8.4 MB: split
        "model.layers.0.self_attn.q_proj.weight": torch.randint(0, 126, (256, 384), dtype=torch.uint8,
                                                                generator=g).view(torch.float8_e4m3fn),
        "model.layers.0.self_attn.q_proj.weight_scale_inv": torch.rand(2, 3, generator=g),
        "model.norm.weight": torch.randn(77, generator=g).to(torch.bfloat16),
    }


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_copy_many_copies_every_byte(threads):
    g = torch.Generator().manual_seed(threads)
    lengths = [1, 63, 4096, (8 << 20) + 13, (17 << 20) + 5]
    src = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in lengths]
    dst = [torch.zeros(n, dtype=torch.uint8) for n in lengths]
    copy_many(list(zip(dst, src)), threads)
    for d, s in zip(dst, src):
        assert np.array_equal(d.numpy(), s.numpy())
    with pytest.raises(ValueError, match="copy pair 0: destination has 3 bytes, source 4"):
        copy_many([(torch.zeros(3, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8))])


@pytest.mark.parametrize("threads", [1, 2])
def test_copy_many_takes_numpy_and_torch_pairs_together(threads):
    rng = np.random.default_rng(threads)
    lengths = [0, 1, (512 << 10) - 1, 512 << 10, (512 << 10) + 1, (3 << 20) + 7]
    src = [rng.integers(0, 256, n, dtype=np.uint8) for n in lengths]
    want = [x.copy() for x in src]  # the reference: the source bytes, copied before the call
    dst = [np.zeros(n, np.uint8) if i % 2 else torch.zeros(n, dtype=torch.uint8) for i, n in enumerate(lengths)]
    copy_many([(d, s if i % 2 else torch.from_numpy(s)) for i, (d, s) in enumerate(zip(dst, src))], threads)
    for d, w in zip(dst, want):
        assert np.array_equal(np.asarray(d), w)
    with pytest.raises(ValueError, match="copy pair 1: destination has 5 bytes, source 6"):
        copy_many([(np.zeros(1, np.uint8), np.ones(1, np.uint8)), (np.zeros(5, np.uint8), np.zeros(6, np.uint8))])


def _transport(kind: str):
    return {"inprocess": lambda: InProcessTransport(),
            "shm": lambda: SharedMemoryTransport(bucket_bytes=1 << 20),  # the receiver reads rings: negotiated
            "shm_ring_laps": lambda: SharedMemoryTransport(ring_slot_bytes=64 << 10, ring_slots=3),  # ~45 laps
            "shm_buckets": lambda: SharedMemoryTransport(bucket_bytes=1 << 20, ring=False),
            "shm_unstreamed": lambda: SharedMemoryTransport(stream=False)}[kind]()


@pytest.mark.parametrize("transport", ["inprocess", "shm", "shm_ring_laps", "shm_buckets", "shm_unstreamed"])
def test_receiver_writes_preallocated_tensors_in_place(transport):
    first = _tensors(0)
    mine = {k: torch.zeros_like(v) for k, v in first.items()}
    ids = {k: v.data_ptr() for k, v in mine.items()}
    rec = TorchParamsReceiver(mine, allocate=False, copy_threads=2)
    r = ThreadReceiver(lambda m, a: getattr(rec, m)(*a))
    tr = _transport(transport)
    try:
        for step in range(3):
            ts = _tensors(step)
            tr.send(ts, {0: {"k_scale": 0.5 + step}}, step + 1, [r], timeout_s=60)
            if transport != "inprocess":
                assert tr.last_mode == {"shm_buckets": "stream", "shm_unstreamed": "unstreamed"}.get(transport, "ring")
            assert rec.fp8rl_weights_version() == step + 1
            assert rec.kv_scales == {0: {"k_scale": 0.5 + step}}
            for k, v in ts.items():
                assert mine[k].data_ptr() == ids[k] and rec.params[k] is mine[k]  # the caller's own tensors
                assert np.array_equal(_bytes(mine[k]), _bytes(v)), (step, k)
    finally:
        rec.fp8rl_release_shm()
        tr.close()


class DumpingReceiver(TorchParamsReceiver):
    """A receiver process's TorchParamsReceiver that can hand its tensors' bytes back (cross-process checks)."""

    def dump(self) -> dict:
        return {k: (str(v.dtype), tuple(v.shape), _bytes(v).tobytes()) for k, v in self.params.items()}


def test_ring_to_a_receiver_process_is_bit_exact_and_reuses_its_tensors():
    from rollout_bridge.transports import ProcessReceiver

    child = ProcessReceiver(DumpingReceiver, name="ring-child")
    tr = SharedMemoryTransport(ring_slot_bytes=256 << 10, ring_slots=4)  # 8.6 MB through 1 MiB: ~8 laps
    try:
        for step in range(3):
            ts = _tensors(10 + step)
            st = tr.send(ts, {}, 7 + step, [child], timeout_s=120)
            assert tr.last_mode == "ring" and st.buckets == tr.last_buckets > 4 * 8
            assert child.call("fp8rl_weights_version").result(30) == 7 + step
            got = child.call("dump").result(60)
            assert set(got) == set(ts)
            for k, v in ts.items():
                assert got[k] == (str(v.dtype), tuple(v.shape), _bytes(v).tobytes()), (step, k)
    finally:
        child.call("fp8rl_release_shm").result(30)
        child.close()
        tr.close()


class _Keeper(WeightReceiverMixin):  # iterates the stream and keeps every tensor it is handed
    def __init__(self):
        self.kept = []

    def _fp8rl_load(self, named, kv_scales, version):
        self.kept.append(dict(named))


class _TwoWorkers(_Keeper):
    def fp8rl_shm_ring_reader(self):
        return [True, True]  # what a collective_rpc over two workers answers


def test_ring_gives_other_consumers_tensors_they_may_keep():
    """A consumer that keeps the tensors it is handed (vLLM's layerwise reload buffers shards) gets fresh tensors
    from a ring, valid after the ring was refilled by later syncs; without ``ring=True`` such a receiver (not a ring
    reader, or several workers) gets the payload-sized buckets."""
    rec = _Keeper()
    r = ThreadReceiver(lambda m, a: getattr(rec, m)(*a))
    tr = SharedMemoryTransport(ring=True, ring_slot_bytes=64 << 10, ring_slots=2)
    try:
        sent = [_tensors(20 + step) for step in range(3)]
        for step, ts in enumerate(sent):
            tr.send(ts, {}, step + 1, [r], timeout_s=60)
            assert tr.last_mode == "ring" and rec.fp8rl_weights_version() == step + 1
        for ts, kept in zip(sent, rec.kept):
            assert list(kept) == list(ts)  # in the sender's order
            for k, v in ts.items():
                assert kept[k].dtype == v.dtype and kept[k].shape == v.shape
                assert np.array_equal(_bytes(kept[k]), _bytes(v)), k
    finally:
        rec.fp8rl_release_shm()
        tr.close()
    for cls in (_Keeper, _TwoWorkers):
        rec = cls()
        r = ThreadReceiver(lambda m, a: getattr(rec, m)(*a))
        tr = SharedMemoryTransport(bucket_bytes=1 << 20)
        try:
            tr.send(_tensors(0), {}, 1, [r], timeout_s=60)
            assert tr.last_mode == "stream" and rec.fp8rl_weights_version() == 1
        finally:
            rec.fp8rl_release_shm()
            tr.close()


def test_ring_feeds_several_receivers_and_readers_refuse_other_syncs():
    import time
    from multiprocessing import shared_memory

    from rollout_bridge.transports import ShmRingStream, plan_buckets

    class Late(TorchParamsReceiver):  # starts reading after the sender has filled the whole ring and waits
        def _fp8rl_load(self, named, kv_scales, version):
            time.sleep(0.2)
            super()._fp8rl_load(named, kv_scales, version)

    recs = [TorchParamsReceiver(copy_threads=1), Late(), TorchParamsReceiver(copy_threads=1)]
    rs = [ThreadReceiver(lambda m, a, rec=rec: getattr(rec, m)(*a), name=f"r{i}") for i, rec in enumerate(recs)]
    tr = SharedMemoryTransport(ring_slot_bytes=128 << 10, ring_slots=2)  # the slowest reader paces the sender
    try:
        for step in range(2):
            ts = _tensors(30 + step)
            tr.send(ts, {}, step + 1, rs, timeout_s=60)
            assert tr.last_mode == "ring"
            for rec in recs:
                assert rec.fp8rl_weights_version() == step + 1
                assert all(np.array_equal(_bytes(rec.params[k]), _bytes(v)) for k, v in ts.items())
    finally:
        for rec in recs:
            rec.fp8rl_release_shm()
        tr.close()
    # the reader side alone: another sync's chunks are never taken; an aborted sender fails the reader at once
    entries, _ = plan_buckets({"x": torch.zeros(1000, dtype=torch.uint8)}, 1 << 62)
    ring, ctl_seg = torch.zeros(2 * 512, dtype=torch.uint8), shared_memory.SharedMemory(create=True, size=24)
    try:
        ctl = np.ndarray((3,), np.int64, buffer=ctl_seg.buf)
        ctl[:] = [4, 2, 0]  # sync 4 is complete; a reader of sync 5 must wait for it
        with pytest.raises(TimeoutError, match="ring chunk 0 of shared-memory sync 5 not ready"):
            ShmRingStream(ring.numpy(), 512, 2, entries, ctl_seg.buf, seq=5, reader=0, timeout_s=0.2).copy_into(
                [torch.zeros(1000, dtype=torch.uint8)])
        ctl[:] = [5, -1, 0]
        with pytest.raises(WeightSyncError, match="sender aborted shared-memory sync 5 before ring chunk 0"):
            ShmRingStream(ring.numpy(), 512, 2, entries, ctl_seg.buf, seq=5, reader=0).copy_into(
                [torch.zeros(1000, dtype=torch.uint8)])
        stream = ShmRingStream(ring.numpy(), 512, 2, entries, ctl_seg.buf, seq=5, reader=0)
        stream.finish()
        assert ctl[2] == -5  # a reader that stops early says so: the sender fails instead of waiting
        del ctl, stream
    finally:
        ctl_seg.close()
        ctl_seg.unlink()


def test_ring_reader_failure_fails_the_sender_fast_by_name():
    import time

    ts = _tensors(3)
    mine = {k: torch.zeros_like(v) for k, v in ts.items()}
    mine["model.norm.weight"] = torch.zeros(78, dtype=torch.bfloat16)
    rec = TorchParamsReceiver(mine, allocate=False)
    r = ThreadReceiver(lambda m, a: getattr(rec, m)(*a), name="picky")
    tr = SharedMemoryTransport(ring_slot_bytes=64 << 10, ring_slots=2)  # the sender must wait on the reader
    t0 = time.monotonic()
    try:
        with pytest.raises(WeightSyncError, match=r"picky.*model.norm.weight: preallocated \(78,\)"):
            tr.send(ts, {}, 5, [r], timeout_s=60)
        assert time.monotonic() - t0 < 10  # on the reader's stop word, not at the 60 s timeout
        assert rec.fp8rl_weights_version() == -1
        mine["model.norm.weight"] = torch.zeros(77, dtype=torch.bfloat16)  # fixed: the next sync succeeds
        rec.params["model.norm.weight"] = mine["model.norm.weight"]
        tr.send(ts, {}, 6, [r], timeout_s=60)
        assert rec.fp8rl_weights_version() == 6
        assert all(np.array_equal(_bytes(mine[k]), _bytes(v)) for k, v in ts.items())
    finally:
        rec.fp8rl_release_shm()
        tr.close()


def test_receiver_allocates_on_first_sync_and_names_mismatches():
    ts = _tensors(1)
    rec = TorchParamsReceiver()
    rec.fp8rl_load_tensors(list(ts.items()), {}, 3)
    assert sorted(rec.params) == sorted(ts) and rec.fp8rl_weights_version() == 3
    assert all(rec.params[k] is not ts[k] and np.array_equal(_bytes(rec.params[k]), _bytes(ts[k])) for k in ts)

    bad = dict(ts)
    bad["model.norm.weight"] = torch.zeros(78, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"model.norm.weight: preallocated \(77,\) torch.bfloat16, received \(78,\)"):
        rec.fp8rl_load_tensors(list(bad.items()), {}, 4)
    assert rec.fp8rl_weights_version() == -1  # a failed sync is never taken for a complete one

    strict = TorchParamsReceiver({}, allocate=False)
    with pytest.raises(KeyError, match="model.embed_tokens.weight, which has no preallocated tensor"):
        strict.fp8rl_load_tensors(list(ts.items()), {}, 1)
    r = ThreadReceiver(lambda m, a: getattr(strict, m)(*a))
    with pytest.raises(WeightSyncError):
        InProcessTransport().send(ts, {}, 1, [r], timeout_s=30)

    with pytest.raises(ValueError, match="x is not contiguous"):
        TorchParamsReceiver({"x": torch.zeros(4, 6).t()})


def test_receiver_follows_replaced_tensors_and_writes_scalars():
    """The receiver caches its destinations' byte views: a tensor replaced (or moved) between syncs is the one
    written, a non-contiguous replacement is refused by name; 0-d and non-contiguous sources are copied exactly."""
    ts = _tensors(2)
    ts["model.layers.0.self_attn.k_scale_like"] = torch.tensor(0.375)  # 0-d float32
    ts["model.layers.0.mlp.gate_proj.weight"] = torch.randn(6, 10).to(torch.bfloat16).t()  # non-contiguous
    want = {k: _bytes(v).copy() for k, v in ts.items()}  # reference: the sender's bytes
    rec = TorchParamsReceiver(copy_threads=2)
    rec.fp8rl_load_tensors(list(ts.items()), {}, 1)
    assert all(np.array_equal(_bytes(rec.params[k]), want[k]) for k in ts)
    assert rec.params["model.layers.0.self_attn.k_scale_like"].shape == ()

    name = "model.layers.0.self_attn.q_proj.weight"
    old = rec.params[name]
    new = rec.params[name] = torch.zeros_like(old)
    old.zero_()
    rec.fp8rl_load_tensors(list(ts.items()), {}, 2)
    assert rec.params[name] is new and np.array_equal(_bytes(new), want[name])
    assert not _bytes(old).any()  # the replaced tensor is no longer written
    new.set_(torch.zeros_like(new).untyped_storage(), 0, new.shape)  # same object, moved to other memory
    rec.fp8rl_load_tensors(list(ts.items()), {}, 3)
    assert np.array_equal(_bytes(new), want[name]) and rec.fp8rl_weights_version() == 3

    rec.params["model.norm.weight"] = torch.zeros(77, 2, dtype=torch.bfloat16)[:, 0]
    with pytest.raises(ValueError, match="model.norm.weight is not contiguous"):
        rec.fp8rl_load_tensors(list(ts.items()), {}, 4)
    assert rec.fp8rl_weights_version() == -1


def test_handover_views_alias_the_jax_buffers_for_every_dtype():
    """torch_sync_tensors / jax_to_torch on CPU: each view has the array's shape and dtype and aliases its bytes
    (reference: numpy's bytes of the JAX array), 0-d scalars included."""
    import jax.numpy as jnp

    from fp8rl_jax.rollout.types import ExportedWeights
    from rollout_bridge.dlpack import jax_to_torch, torch_sync_tensors

    rng = np.random.default_rng(0)
    arrays = {
        "model.embed_tokens.weight": jnp.asarray(rng.standard_normal((33, 17)), jnp.bfloat16),
        "model.layers.0.mlp.up_proj.weight": jnp.asarray(rng.standard_normal((40, 24)), jnp.float8_e4m3fn),
        "model.layers.0.mlp.up_proj.weight_scale_inv": jnp.asarray(rng.random((1, 1)), jnp.float32),
        "model.layers.0.input_layernorm.bias_like": jnp.asarray(1.25, jnp.float32),  # 0-d
        "model.layers.1.self_attn.k_scale": jnp.asarray(0.5, jnp.float32),  # a KV scale: split off
    }
    for x in arrays.values():
        t = jax_to_torch(x)
        assert tuple(t.shape) == x.shape and str(t.dtype).removeprefix("torch.") == str(x.dtype)
        assert np.array_equal(_bytes(t), np.asarray(x).reshape(-1).view(np.uint8))
        assert t.data_ptr() == x.unsafe_buffer_pointer()  # a view, not a copy
    w = ExportedWeights(tensors=arrays, format="fp8_blockwise", block_size=128, version=1, metadata={})
    got, kv = torch_sync_tensors(w, "native")
    assert kv == {1: {"k_scale": 0.5}} and "model.layers.1.self_attn.k_scale" not in got
    assert list(got)[0] == "model.embed_tokens.weight"
    for k, t in got.items():
        assert np.array_equal(_bytes(t), np.asarray(arrays[k]).reshape(-1).view(np.uint8)), k


def test_tp_rank_views_feed_the_receiver_without_copies():
    """One device (tp = 1): the rank's torch views alias the export's shard buffers, and a receiver gets the bytes
    of vLLM's fused qkv_proj = [q; k; v] (numpy concatenation of the HF tensors as the reference)."""
    import jax
    import jax.numpy as jnp

    from fp8rl_jax.export_tp import export_tp_shards
    from fp8rl_jax.models.config import ModelConfig, hf_param_shapes
    from fp8rl_jax.parallel.mesh import make_mesh
    from rollout_bridge.dlpack import tp_rank_torch_tensors

    cfg = ModelConfig(model_type="qwen3", vocab_size=128, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=128, qk_norm=True)
    rng = np.random.default_rng(0)
    params = {k: jnp.asarray(rng.standard_normal(s).astype(np.float32)) for k, s in hf_param_shapes(cfg).items()}
    ex = export_tp_shards(params, cfg, make_mesh("tensor=1", devices=jax.devices()[:1]), fmt="bf16")
    views = tp_rank_torch_tensors(ex, 0)
    name = "model.layers.0.self_attn.qkv_proj.weight"
    assert views[name].data_ptr() == ex.tensors[name].addressable_shards[0].data.unsafe_buffer_pointer()
    want = np.concatenate([np.asarray(params[f"model.layers.0.self_attn.{p}_proj.weight"].astype(jnp.bfloat16))
                           for p in "qkv"])
    rec = TorchParamsReceiver()
    rec.fp8rl_load_tensors(list(views.items()), {}, 1)
    assert np.array_equal(_bytes(rec.params[name]), want.reshape(-1).view(np.uint8))
    with pytest.raises(ValueError, match=r"rank 1 is not in \[0, 1\)"):
        tp_rank_torch_tensors(ex, 1)


_OPENED: list = []


def _fake_rebuild(*args):
    """Stands in for torch's rebuild_cuda_tensor: records the device index it was given (args[6])."""
    _OPENED.append(args[6])
    return torch.full((args[1],), args[0], dtype=torch.uint8)


def test_cuda_ipc_buckets_are_opened_once_per_bucket_set():
    """The receiver side of the persistent CUDA IPC buckets, on CPU with a stand-in for the handle rebuild:
    handles are opened (on the receiver's device index) only when the sender names a new bucket set."""
    _OPENED.clear()
    rec = TorchParamsReceiver()
    meta = {"handles": [(_fake_rebuild, (7, 64, 0, 0, 0, 0, 3)), (_fake_rebuild, (9, 32, 0, 0, 0, 0, 3))],
            "buckets_id": "a"}
    first = rec._fp8rl_ipc_buckets(meta, 0)
    again = rec._fp8rl_ipc_buckets(meta, 0)
    assert again is first and _OPENED == [0, 0]  # mapped to our device once; the second sync opens nothing
    assert [int(b[0]) for b in first] == [7, 9]
    rec._fp8rl_ipc_buckets(dict(meta, buckets_id="b"), 1)  # a new layout: opened again
    assert _OPENED == [0, 0, 1, 1]
    rec._fp8rl_ipc_buckets({"handles": meta["handles"]}, 0)  # an old sender without ids: always opened
    assert len(_OPENED) == 6
