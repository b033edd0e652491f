"""A weight receiver in another process (spawned), for the cross-process sync tests: the child holds a
:class:`rollout_bridge.transports.WeightReceiverMixin` that copies what it receives into its own tensors and answers
RPCs over a pipe (the shape of a vLLM worker's ``collective_rpc``, without vLLM)."""

from __future__ import annotations

import multiprocessing as mp
import threading


def _child(conn):
    from rollout_bridge.transports import WeightReceiverMixin

    class Copy(WeightReceiverMixin):
        def __init__(self):
            self.params = {}

        def _fp8rl_load(self, named, kv_scales, version):
            for name, t in named:
                self.params[name] = t.clone()  # the receiver's own memory, like vLLM's parameters

        def dump(self):
            return {k: (str(v.dtype), tuple(v.shape), v.contiguous().view(-1).view(__import__("torch").uint8)
                        .numpy().tobytes()) for k, v in self.params.items()}

    rec = Copy()
    while True:
        msg = conn.recv()
        if msg is None:
            rec.fp8rl_release_shm()
            return
        method, args = msg
        try:
            conn.send(("ok", getattr(rec, method)(*args)))
        except Exception as e:  # noqa: BLE001 - reported to the caller
            conn.send(("err", f"{type(e).__name__}: {e}"))


class _Pending:
    def __init__(self, proc):
        self.proc, self.done = proc, threading.Event()

    def result(self, timeout=None):
        if not self.proc.conn.poll(timeout):
            raise TimeoutError("child receiver did not answer")
        status, value = self.proc.conn.recv()
        if status != "ok":
            raise RuntimeError(value)
        return value


class ProcessReceiver:
    """``call(method, *args) -> pending`` to a receiver in a spawned child process (one call in flight)."""

    name = "child-process"

    def __init__(self):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_child, args=(child,), daemon=True)
        self.proc.start()

    def call(self, method, *args):
        self.conn.send((method, args))
        return _Pending(self)

    def close(self):
        try:
            self.conn.send(None)
        finally:
            self.proc.join(30)
