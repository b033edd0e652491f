"""The embedded engine on a device mesh (issue 19): greedy decoding on meshes tensor=2, tensor=4, data=2 x
tensor=2 and fsdp=2 x tensor=2 equals the one-device engine token for token (float32, tiny dense and MoE models),
and the weights really are split over the devices. Runs in a subprocess with 8 host CPU devices
(``--xla_force_host_platform_device_count=8`` for that process only)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))
MESHES = ("tensor=2", "tensor=4", "data=2,tensor=2", "fsdp=2,tensor=2")


def _child(arch: str) -> dict:
    import jax
    import numpy as np

    from fp8rl_jax.export import export_weights
    from fp8rl_jax.models.config import ModelConfig
    from fp8rl_jax.models.decoder import named_params
    from fp8rl_jax.models.loading import build_model
    from fp8rl_jax.models.moe import tiny_qwen3_moe_config
    from fp8rl_jax.parallel.mesh import make_mesh
    from fp8rl_jax.rollout.engine import JaxRolloutEngine
    from fp8rl_jax.rollout.types import SamplingParams

    if arch == "moe":
        cfg = tiny_qwen3_moe_config(512, hidden_size=64, num_hidden_layers=2, num_experts=4, num_experts_per_tok=2)
    else:
        cfg = ModelConfig(model_type="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          max_position_embeddings=256, tie_word_embeddings=False, eos_token_id=1, pad_token_id=0)
    model = build_model(cfg, seed=3)
    weights = export_weights(named_params(model), "float32")
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(2, 512, n))) for n in (5, 9, 3, 7)]
    sp = SamplingParams(n=1, temperature=0.0, max_tokens=12, ignore_eos=True)
    ref = JaxRolloutEngine(cfg, weights, precision="float32", log_kv_cache=False).generate(prompts, sp)
    out = {}
    for shape in MESHES:
        eng = JaxRolloutEngine(cfg, weights, precision="float32", log_kv_cache=False, mesh=make_mesh(shape))
        got = eng.generate(prompts, sp)
        q = eng.model.model.layers[0].self_attn.q_proj.weight[...]
        out[shape] = {"same_tokens": bool(np.array_equal(got.response_token_ids, ref.response_token_ids)),
                      "max_logprob_diff": float(np.max(np.abs(got.rollout_logprobs - ref.rollout_logprobs))),
                      "q_proj_devices": len(q.sharding.device_set),
                      "q_proj_shard_rows": int(q.addressable_shards[0].data.shape[0])}
        eng.update_weights(weights)  # a sync keeps the placement
        out[shape]["after_sync_devices"] = len(eng.model.model.layers[0].self_attn.q_proj.weight[...].sharding.device_set)
    out["devices"] = jax.device_count()
    return out


@pytest.mark.parametrize("arch", ["dense", "moe"])
def test_sharded_greedy_decode_equals_one_device(arch):
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    r = subprocess.run([sys.executable, HERE, arch], env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["devices"] == 8
    for shape in MESHES:
        got = res[shape]
        assert got["same_tokens"], (shape, got)
        assert got["max_logprob_diff"] < 1e-4, (shape, got)
        tensor = int(dict(kv.split("=") for kv in shape.split(","))["tensor"])
        assert got["q_proj_shard_rows"] == 64 // tensor, (shape, got)  # 4 heads x 16 split over tensor
        assert got["q_proj_devices"] > 1 and got["after_sync_devices"] == got["q_proj_devices"], (shape, got)


if __name__ == "__main__":
    print(json.dumps(_child(sys.argv[1])))
