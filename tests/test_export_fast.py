"""The one-program exporter (issue 18): same bits as the stacked exporter, finiteness judged inside the program,
the cached parameter reader, and the streamed shared-memory transport's logic (CPU)."""

from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from fp8rl_jax import export as ex
from fp8rl_jax.export import ModelParamsReader, export_weights
from fp8rl_jax.fp8 import quantize_weights_batched
from fp8rl_jax.models.config import ModelConfig
from fp8rl_jax.models.decoder import named_params
from fp8rl_jax.models.loading import build_model

# ragged shapes on purpose: k_proj 192 rows, hidden 320 (not multiples of 128)
CFG = ModelConfig(model_type="llama", vocab_size=300, hidden_size=320, intermediate_size=448, num_hidden_layers=2,
                  num_attention_heads=6, num_key_value_heads=3, head_dim=64, eos_token_id=2, pad_token_id=0)


@pytest.fixture(scope="module")
def model():
    return build_model(CFG, seed=3)


def _bits(x):
    a = np.asarray(x)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _old_export(params, fmt, unquantized=()):
    out, _ = ex._export(dict(params), fmt, 128, False, tuple(sorted(unquantized)), check=False, stack=True)
    return out


@pytest.mark.parametrize("fmt", ["fp8_blockwise", "bf16", "float32"])
def test_one_program_export_is_bit_identical_to_the_stacked_one(model, fmt):
    params = named_params(model)
    unq = ("model.layers.1.self_attn.k_proj",)
    new = export_weights(params, fmt, unquantized=unq).tensors
    old = _old_export(params, fmt, unq)
    assert list(new) == sorted(old)
    for k in old:
        assert new[k].dtype == old[k].dtype and new[k].shape == old[k].shape, k
        np.testing.assert_array_equal(_bits(new[k]), _bits(old[k]), err_msg=k)
    if fmt == "fp8_blockwise":
        assert new["model.layers.0.self_attn.k_proj.weight"].shape == (192, 320)  # [out, in]
        assert new["model.layers.0.self_attn.k_proj.weight_scale_inv"].shape == (2, 3)
        assert "model.layers.1.self_attn.k_proj.weight_scale_inv" not in new
        assert new["model.layers.1.self_attn.k_proj.weight"].dtype == jnp.bfloat16


def test_quantize_weights_batched_stack_false_is_bit_identical():
    rng = np.random.default_rng(0)
    ws = {f"l{i}.{n}": jnp.asarray(rng.standard_normal(s).astype(np.float32) * 0.05)
          for i in range(3) for n, s in {"q": (256, 320), "k": (192, 320), "o": (320, 256)}.items()}
    a = quantize_weights_batched(ws, stack=True)
    b = quantize_weights_batched(ws, stack=False)
    for k in ws:
        for x, y in zip(a[k], b[k]):
            np.testing.assert_array_equal(_bits(x), _bits(y), err_msg=k)


@pytest.mark.parametrize("name", ["model.layers.0.mlp.up_proj.weight", "model.layers.1.self_attn.k_proj.weight",
                                  "model.norm.weight", "model.embed_tokens.weight"])
@pytest.mark.parametrize("bad", [np.nan, -np.nan, np.inf, -np.inf])
def test_non_finite_weights_are_named(model, name, bad):
    params = dict(named_params(model))
    w = np.array(params[name])
    rng = np.random.default_rng(abs(hash((name, str(bad)))) % 2**32)
    for _ in range(3):  # several placements: XLA CPU's vectorized max drops NaN in some lanes
        idx = tuple(int(rng.integers(d)) for d in w.shape)
        w2 = w.copy()
        w2[idx] = bad
        params[name] = jnp.asarray(w2)
        with pytest.raises(ValueError, match=name.replace(".", r"\.")):
            export_weights(params, "fp8_blockwise", unquantized=("model.layers.1.self_attn.k_proj",))
    params[name] = jnp.asarray(w)


def test_nan_in_quantized_linear_detected_at_every_lane():
    """A NaN in any of the 128 lanes of a block row (the vectorized max's blind spots) is found."""
    w = np.full((128, 256), 0.01, np.float32)
    for j in range(0, 256, 7):
        w2 = w.copy()
        w2[j % 128, j] = np.nan
        with pytest.raises(ValueError, match="q_proj"):
            export_weights({"model.layers.0.self_attn.q_proj.weight": jnp.asarray(w2)})


def test_check_skipped_when_traced_and_finite_export_passes(model):
    params = named_params(model)
    shapes = jax.eval_shape(lambda p: export_weights(p, "fp8_blockwise").tensors, params)
    assert shapes["model.layers.0.mlp.down_proj.weight"].dtype == jnp.float8_e4m3fn
    export_weights(params, "fp8_blockwise", check_finite=False)


def test_model_params_reader_follows_in_place_updates(model):
    reader = ModelParamsReader(model)
    assert list(reader()) == list(named_params(model))

    @nnx.jit
    def bump(m):
        for _, v in nnx.to_flat_state(nnx.state(m, nnx.Param)):
            v[...] = v[...] * 2

    before = {k: np.asarray(v) for k, v in reader().items()}
    bump(model)
    after = reader()
    for k, v in named_params(model).items():
        np.testing.assert_array_equal(np.asarray(after[k]), np.asarray(v))
        np.testing.assert_array_equal(np.asarray(v), before[k] * 2)
    bump(model)  # restore nothing else depends on values; keep the module fixture deterministic in scale only


# --------------------------------------------------------------------------------------------------------------
# streamed shared memory (the sender/reader handshake, in one process)
# --------------------------------------------------------------------------------------------------------------
torch = pytest.importorskip("torch")

from rollout_bridge.transports import (SharedMemoryTransport, ShmBucketStream, ThreadReceiver,  # noqa: E402
                                       WeightReceiverMixin, WeightSyncError, plan_buckets)


class _Copy(WeightReceiverMixin):
    def __init__(self, delay=0.0):
        self.params, self.delay, self.order = {}, delay, []

    def _fp8rl_load(self, named, kv_scales, version):
        for name, t in named:
            self.order.append(name)
            self.params[name] = t.clone()
            time.sleep(self.delay)


def _tensors(n=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(n):
        out[f"model.layers.{i}.w"] = torch.randn(64 + i, 96, generator=g).to(torch.bfloat16)
        out[f"model.layers.{i}.q"] = torch.randint(0, 120, (128, 32), dtype=torch.uint8, generator=g).view(
            torch.float8_e4m3fn)
    return out


@pytest.mark.parametrize("stream", [True, False])
def test_shm_transport_delivers_every_byte_repeatedly(stream):
    rec = _Copy()
    r = ThreadReceiver(lambda m, a: getattr(rec, m)(*a))
    tr = SharedMemoryTransport(bucket_bytes=20_000, stream=stream)
    try:
        for step in range(3):  # the same version each time: the sync counter, not the version, orders the streams
            ts = _tensors(seed=step)
            st = tr.send(ts, {}, 5, [r], timeout_s=30)
            assert st.buckets == tr.last_buckets > 3
            assert rec.fp8rl_weights_version() == 5
            for k, v in ts.items():
                assert torch.equal(rec.params[k].view(torch.uint8), v.view(torch.uint8)), k
    finally:
        rec.fp8rl_release_shm()
        tr.close()


def _stream_fixture(n_buckets=4):
    from multiprocessing import shared_memory

    ts = _tensors(8)
    entries, sizes = plan_buckets(ts, 20_000)
    segs = [torch.zeros(s, dtype=torch.uint8) for s in sizes]
    ctl_seg = shared_memory.SharedMemory(create=True, size=16)
    ctl = np.ndarray((2,), np.int64, buffer=ctl_seg.buf)
    ctl[:] = 0
    return ts, entries, sizes, segs, ctl_seg, ctl


def test_shm_stream_waits_for_each_bucket_and_refuses_other_syncs():
    from rollout_bridge.transports import entries_by_bucket, fill_buckets

    ts, entries, sizes, segs, ctl_seg, ctl = _stream_fixture()
    try:
        ctl[0], ctl[1] = 6, len(sizes)  # an older sync fully written: a reader of sync 7 must not take it
        got, err = [], []

        def read():
            try:
                for name, t in ShmBucketStream(segs, entries, ctl_seg.buf, seq=7, timeout_s=20):
                    got.append((name, t.clone(), int(ctl[1])))
            except Exception as e:  # noqa: BLE001
                err.append(e)

        th = threading.Thread(target=read)
        th.start()
        time.sleep(0.05)
        assert not got  # still waiting: seq 6 is not this sync
        ctl[1] = 0
        ctl[0] = 7
        by_bucket = entries_by_bucket(entries, len(sizes))
        for k in range(len(sizes)):
            time.sleep(0.02)
            fill_buckets(segs, ts, by_bucket[k])
            ctl[1] = k + 1
        th.join(20)
        assert not err and len(got) == len(ts)
        bucket_of = {e.name: e.bucket for e in entries}
        for name, t, ready in got:
            assert ready > bucket_of[name]  # handed out only once its bucket was marked complete
            assert torch.equal(t.view(torch.uint8), ts[name].reshape(t.shape).view(torch.uint8))
    finally:
        del ctl
        ctl_seg.close()
        ctl_seg.unlink()


def test_shm_stream_abort_and_timeout():
    ts, entries, sizes, segs, ctl_seg, ctl = _stream_fixture()
    try:
        ctl[0], ctl[1] = 3, -1
        with pytest.raises(WeightSyncError, match="aborted"):
            list(ShmBucketStream(segs, entries, ctl_seg.buf, seq=3, timeout_s=5))
        ctl[1] = 1
        with pytest.raises(TimeoutError, match="bucket 1"):
            list(ShmBucketStream(segs, entries, ctl_seg.buf, seq=3, timeout_s=0.2))
    finally:
        del ctl
        ctl_seg.close()
        ctl_seg.unlink()


def test_shm_stream_sender_failure_fails_the_reader_fast(monkeypatch):
    from rollout_bridge import transports

    real, calls = transports.fill_buckets, []

    def failing_fill(*a):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("disk on fire")
        return real(*a)

    monkeypatch.setattr(transports, "fill_buckets", failing_fill)
    rec = _Copy()
    r = ThreadReceiver(lambda m, a: getattr(rec, m)(*a))
    tr = SharedMemoryTransport(bucket_bytes=20_000)
    t0 = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match="disk on fire"):
            tr.send(_tensors(), {}, 1, [r], timeout_s=60)
        # the receiver's queue is FIFO: the failed load finished before this call runs
        assert r.call("fp8rl_weights_version").result(10) == -1  # inconsistent, never silently stale
        assert time.monotonic() - t0 < 10  # failed on the abort word, not at its 60 s timeout
    finally:
        rec.fp8rl_release_shm()
        tr.close()
