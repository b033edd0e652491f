"""Issue 18: after each of 3 training steps, what every receiver holds equals the reference export bit for bit:
the embedded engine (in place), a torch consumer in this process (DLPack + in-process transport), and a receiver in
another process (streamed shared memory). The reference is recomputed from the trainer's parameters through the
graph walk (``named_params``) rather than the trainer's cached reader."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch consumer side needs torch (the [vllm] extra)")

from conftest import make_tiny_smollm2_vocab_dir  # noqa: E402
from fp8rl_jax.export import export_weights  # noqa: E402
from fp8rl_jax.models.decoder import named_params  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_checkpoint import fixed_length_dataset, text_reward  # noqa: E402


def _bytes(a) -> bytes:
    return np.ascontiguousarray(np.asarray(a)).view(np.uint8).tobytes()


@pytest.mark.slow
def test_receivers_hold_the_reference_export_after_three_steps(tmp_path):
    from _proc_receiver import CopyAndDumpReceiver
    from fp8rl_jax.trainer import RLTrainer, TrainConfig
    from rollout_bridge.dlpack import torch_sync_tensors
    from rollout_bridge.transports import (InProcessTransport, ProcessReceiver, SharedMemoryTransport, ThreadReceiver,
                                           WeightReceiverMixin)

    class Copy(WeightReceiverMixin):
        params: dict = {}

        def _fp8rl_load(self, named, kv_scales, version):
            self.params = {name: t.clone() for name, t in named}

    cfg = TrainConfig(output_dir=str(tmp_path / "run"), model=make_tiny_smollm2_vocab_dir(tmp_path / "m"),
                      num_steps=3, prompts_per_step=2, samples_per_prompt=2, max_tokens=4, rollout_precision="fp8",
                      learning_rate=1e-2, progress_bar=False)
    tr = RLTrainer(cfg, dataset=fixed_length_dataset())
    tr.reward_fn = text_reward
    local = Copy()
    child = ProcessReceiver(CopyAndDumpReceiver, name="child-process")
    shm = SharedMemoryTransport(bucket_bytes=1 << 20, stream=True)
    seen = []
    try:
        for step in range(1, 4):
            tr.step()
            ref = export_weights(named_params(tr.model), "fp8_blockwise", version=step).tensors
            seen.append(_bytes(ref["model.layers.0.mlp.up_proj.weight_scale_inv"]))
            # the embedded engine (synced by step())
            served = named_params(tr.engine.model)
            for name, want in ref.items():
                assert _bytes(served[name]) == _bytes(want), (step, name)
            # torch consumers: one in this process, one in a child process
            tensors, kv = torch_sync_tensors(tr.export(), "native")
            InProcessTransport().send(tensors, kv, step, [ThreadReceiver(lambda m, a: getattr(local, m)(*a))])
            shm.send(tensors, kv, step, [child], timeout_s=120)
            remote = child.call("dump").result(120)
            assert set(local.params) == set(remote) == set(ref)
            for name, want in ref.items():
                w = _bytes(want)
                assert local.params[name].contiguous().view(-1).view(torch.uint8).numpy().tobytes() == w, (step, name)
                assert remote[name][2] == w and remote[name][1] == tuple(np.shape(want)), (step, name)
    finally:
        child.call("fp8rl_release_shm").result(30)
        child.close()
        shm.close()
    assert len(set(seen)) == 3  # the weights changed every step: the checks above compared three different exports
