"""Colocated rollout on a one-process mesh (issue 19): the embedded engine shares the trainer's devices and its FP8
weights are the trainer's sharded export itself (no gather to one device, no second copy).

References: buffer identity (the engine's weight shards are the export's shard buffers, compared by device
pointer) and byte counts per device. That the sharded engine's rollouts equal the one-device ones is asserted
by tests/test_mesh.py::test_trainer_on_a_mesh_with_micro_batches_equals_one_device, which runs this path.
Runs in a subprocess with 4 host CPU devices (``--xla_force_host_platform_device_count=4`` for that process only).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))


def _child(model_dir: str) -> dict:
    import jax

    from fp8rl_jax.trainer.config import TrainConfig
    from fp8rl_jax.trainer.loop import RLTrainer

    tr = RLTrainer(TrainConfig(output_dir="/nonexistent", model=model_dir, num_steps=1, prompts_per_step=2,
                               samples_per_prompt=2, max_tokens=4, progress_bar=False, checkpoint_every=0,
                               plots=False, mismatch_action="off", verify_sync="first", rollout_precision="fp8",
                               mesh="fsdp=2,tensor=2"))
    seen = {}
    update = tr.engine.update_weights

    def spy(weights):
        seen["w"] = weights
        return update(weights)

    tr.engine.update_weights = spy
    tr.step()
    w = seen["w"]
    aliased = total = 0
    devices, per_device_bytes, whole_bytes = set(), 0, 0
    for name, var in tr.engine._names.items():
        arr, exp = var[...], w.tensors[name]
        total += arr.nbytes
        ptrs = {s.device: s.data.unsafe_buffer_pointer() for s in arr.addressable_shards}
        eptrs = {s.device: s.data.unsafe_buffer_pointer() for s in exp.addressable_shards}
        if ptrs == eptrs:
            aliased += arr.nbytes
        devices |= set(arr.sharding.device_set)
        per_device_bytes += sum(s.data.nbytes for s in arr.addressable_shards if s.device == jax.devices()[0])
        whole_bytes += arr.nbytes
    q = tr.engine.model.model.layers[0].self_attn.q_proj.weight[...]
    return {"stacked": sorted({n.split(".mlp.experts.")[1] for n in w.tensors if ".mlp.experts." in n}),
            "aliased_fraction": aliased / total, "devices": len(devices), "q_dtype": str(q.dtype),
            "q_devices": len(q.sharding.device_set), "device0_fraction": per_device_bytes / whole_bytes}


@pytest.mark.parametrize("arch", ["dense", "moe"])
def test_engine_weights_are_the_sharded_export(tmp_path, arch):
    """Dense, and Qwen3-MoE (the expert stacks [E, N, K] are synced as stacks, ``expert_stacks=True``, so they too
    are the export's buffers: no per-expert split and no restacking copy)."""
    from conftest import make_tiny_run_dir

    if arch == "moe":
        from fp8rl_jax.models.moe import write_tiny_qwen3_moe

        d = str(tmp_path / "tiny_moe")
        write_tiny_qwen3_moe(d)
    else:
        d = make_tiny_run_dir(tmp_path / "tiny")
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
    r = subprocess.run([sys.executable, HERE, d], env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["q_dtype"] == "float8_e4m3fn" and got["q_devices"] == 4, got  # the FP8 engine, on all 4 devices
    assert got["aliased_fraction"] == 1.0, got  # every engine weight is the export's own buffer: no copy
    assert got["device0_fraction"] < 0.5, got  # and device 0 holds a share, not the whole model
    if arch == "moe":  # the sync carried the stacks under their stacked names
        assert got["stacked"] == sorted(f"{p}_proj.weight{s}" for p in ("down", "gate", "up")
                                        for s in ("", "_scale_inv")), got


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    print(json.dumps(_child(sys.argv[1])))
