"""Export into vLLM's tensor-parallel layout, each device quantizing its own shard (issue 18, fp8rl_jax.export_tp).

Reference: the whole-tensor export (:func:`fp8rl_jax.export.export_weights` on one device, the format vLLM
loads from a checkpoint), cut per rank by this file's own numpy rendering of vLLM's weight loaders
(``QKVParallelLinear``: q rows split, kv heads split or replicated ``r // (tp / Hkv)``;
``MergedColumnParallelLinear`` / ``FusedMoE`` w13: gate then up rows; ``RowParallelLinear`` / w2: columns;
``VocabParallelEmbedding``: vocab padded to 64, rows past the vocab zero). Every rank's shard, on every device
that holds it, must equal that reference byte for byte. The trainer's params arrive sharded by the project's
rules; the compiled program must not gather whole tensors (checked in its HLO). Runs in a subprocess with 8 host
CPU devices (``--xla_force_host_platform_device_count=8`` for that process only).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))
# (mesh, tp axes, arch): kv heads split (tp=2) and replicated (tp=4 > 2 kv heads); TP group inside and across mesh
# axes; trainer params sharded over fsdp as well, so the program must reshard.
CASES = (("tensor=2", ("tensor",), "dense"), ("fsdp=4,tensor=2", ("tensor",), "dense"),
         ("fsdp=2,tensor=4", ("tensor",), "dense"), ("fsdp=2,tensor=2,data=2", ("fsdp", "tensor"), "dense"),
         ("fsdp=4,tensor=2", ("tensor",), "moe"))


def _config(arch: str):
    from fp8rl_jax.models.config import ModelConfig

    common = dict(vocab_size=1000, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=128, qk_norm=True, tie_word_embeddings=False)
    if arch == "moe":
        return ModelConfig(model_type="qwen3_moe", intermediate_size=512, num_experts=4, num_experts_per_tok=2,
                           moe_intermediate_size=256, norm_topk_prob=True, **common)
    return ModelConfig(model_type="qwen3", intermediate_size=512, **common)


def _bytes(x) -> np.ndarray:
    a = np.ascontiguousarray(np.asarray(x))
    return a.reshape(-1).view(np.uint8)


def vllm_rank_local(full: dict, cfg, tp: int, r: int) -> dict:
    """numpy: what vLLM TP rank ``r`` holds after loading the whole-tensor export ``full`` (names -> arrays)."""
    d, hkv = cfg.head_dim, cfg.num_key_value_heads

    def rows(a, parts, i):  # rows i of `parts` equal slices (a scale grid: block rows)
        n = a.shape[0] // parts
        return a[i * n:(i + 1) * n]

    def kv(a, block):  # head (or its block rows) of rank r
        if hkv >= tp:
            return rows(a, tp, r)
        per_head = d // block
        h = r // (tp // hkv)
        return a[h * per_head:(h + 1) * per_head]

    def cols(a):
        n = a.shape[1] // tp
        return a[:, r * n:(r + 1) * n]

    out = {}
    for name, a in full.items():
        scale = name.endswith("_scale_inv")
        block = 128 if scale else 1
        base = name[: -len("_scale_inv")] if scale else name
        suffix = "weight_scale_inv" if scale else "weight"
        m = re.match(r"(model\.layers\.\d+\.)(.*)$", base)
        if base in ("model.embed_tokens.weight", "lm_head.weight"):
            padded = -(-a.shape[0] // 64) * 64
            per = padded // tp
            local = np.zeros((per, a.shape[1]), a.dtype)
            lo, hi = r * per, min((r + 1) * per, a.shape[0])
            local[: hi - lo] = a[lo:hi]
            out[name] = local
            continue
        if not m:
            out[name] = a
            continue
        p, rest = m.groups()
        if rest in ("self_attn.q_proj.weight",):
            out.setdefault(f"{p}self_attn.qkv_proj.{suffix}", {})["q"] = rows(a, tp, r)
        elif rest in ("self_attn.k_proj.weight", "self_attn.v_proj.weight"):
            out.setdefault(f"{p}self_attn.qkv_proj.{suffix}", {})[rest[10]] = kv(a, block)
        elif rest in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
            out.setdefault(f"{p}mlp.gate_up_proj.{suffix}", {})[rest[4:6]] = rows(a, tp, r)
        elif rest in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
            out[name] = cols(a)
        elif re.match(r"mlp\.experts\.\d+\.(gate|up)_proj\.weight$", rest):
            j, kind = re.match(r"mlp\.experts\.(\d+)\.(gate|up)", rest).groups()
            out.setdefault(f"{p}mlp.experts.w13_{suffix}", {})[(int(j), kind)] = rows(a, tp, r)
        elif re.match(r"mlp\.experts\.\d+\.down_proj\.weight$", rest):
            j = int(re.match(r"mlp\.experts\.(\d+)", rest).group(1))
            out.setdefault(f"{p}mlp.experts.w2_{suffix}", {})[j] = cols(a)
        else:  # norms, router
            out[name] = a
    for name, v in list(out.items()):
        if not isinstance(v, dict):
            continue
        if ".qkv_proj." in name:
            out[name] = np.concatenate([v["q"], v["k"], v["v"]])
        elif ".gate_up_proj." in name:
            out[name] = np.concatenate([v["ga"], v["up"]])
        elif ".w13_" in name:
            e = max(j for j, _ in v) + 1
            out[name] = np.stack([np.concatenate([v[(j, "gate")], v[(j, "up")]]) for j in range(e)])
        else:
            out[name] = np.stack([v[j] for j in range(len(v))])
    return out


def _collective_sizes(hlo: str) -> list[int]:
    """Per-device element count of the largest array each collective (all-gather, all-to-all, all-reduce,
    collective-permute) of the compiled ``hlo`` produces."""
    sizes = []
    for line in hlo.splitlines():
        m = re.search(r"= (.+?) (all-gather|all-to-all|all-reduce|collective-permute)(-start)?\(", line)
        if m:
            dims = [d for d in re.findall(r"[a-z0-9]+\[([\d,]*)\]", m.group(1))]
            sizes.append(max(int(np.prod([int(x) for x in d.split(",") if x] or [1])) for d in dims))
    return sizes


def _child() -> dict:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    from fp8rl_jax.export import export_weights
    from fp8rl_jax.export_tp import export_tp_shards, lower_export_tp
    from fp8rl_jax.models.config import hf_param_shapes
    from fp8rl_jax.parallel.mesh import make_mesh
    from fp8rl_jax.parallel.rules import sharding_plan

    results = {}
    for mesh_shape, tp_axes, arch in CASES:
        cfg = _config(arch)
        rng = np.random.default_rng(7)
        host = {k: (rng.standard_normal(s) * 0.05).astype(np.float32) for k, s in hf_param_shapes(cfg).items()}
        full = {k: np.asarray(v) for k, v in export_weights({k: jnp.asarray(v) for k, v in host.items()},
                                                            "fp8_blockwise").tensors.items()}
        mesh = make_mesh(mesh_shape)
        plan = sharding_plan({k: v.shape for k, v in host.items()}, mesh)
        params = {k: jax.device_put(v, NamedSharding(mesh, plan.specs[k])) for k, v in host.items()}
        ex = export_tp_shards(params, cfg, mesh, tp_axes=tp_axes, version=3)
        res = {"tp": ex.tp, "mismatch": [], "holders": [], "names_equal": None}
        for r in range(ex.tp):
            want = vllm_rank_local(full, cfg, ex.tp, r)
            if r == 0:
                res["names_equal"] = sorted(want) == sorted(ex.tensors)
                res["extra"] = sorted(set(ex.tensors) ^ set(want))[:4]
            devs = ex.rank_devices(r)
            res["holders"].append(sorted(d.id for d in devs))
            for dev in devs:
                got = ex.rank_tensors(r, dev)
                for k, w in want.items():
                    g = got.get(k)
                    if g is None or g.shape[1:] != w.shape or g.dtype != w.dtype or \
                            not np.array_equal(_bytes(g[0]), _bytes(w)):
                        res["mismatch"].append([r, dev.id, k])
        res["mismatch"] = res["mismatch"][:5]
        o_name = "model.layers.0.self_attn.o_proj.weight"
        res["o_proj_shard_shape"] = list(ex.tensors[o_name].addressable_shards[0].data.shape)
        hlo = lower_export_tp(params, cfg, mesh, tp_axes=tp_axes).compile().as_text()
        res["collective_sizes"] = _collective_sizes(hlo)
        res["max_local_size"] = max(int(np.prod(a.shape[1:])) for a in ex.tensors.values())
        res["mesh_size"] = int(mesh.devices.size)
        results[f"{arch}:{mesh_shape}:{'+'.join(tp_axes)}"] = res

    # bad input: NaN in a k_proj names the fused output; a rank's part of a block dimension not a multiple of 128
    cfg = _config("dense")
    rng = np.random.default_rng(1)
    host = {k: (rng.standard_normal(s) * 0.05).astype(np.float32) for k, s in hf_param_shapes(cfg).items()}
    host["model.layers.1.self_attn.k_proj.weight"][3, 5] = np.nan
    errors = {}
    try:
        export_tp_shards({k: jnp.asarray(v) for k, v in host.items()}, cfg, make_mesh("tensor=2"))
    except ValueError as e:
        errors["nan"] = str(e)
    host["model.layers.1.self_attn.k_proj.weight"][3, 5] = 0.0
    try:
        export_tp_shards({k: jnp.asarray(v) for k, v in host.items()}, cfg, make_mesh("tensor=8"))
    except ValueError as e:
        errors["blocks"] = str(e)
    results["errors"] = errors
    return results


@pytest.fixture(scope="module")
def child_results():
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    r = subprocess.run([sys.executable, HERE], env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", [f"{a}:{m}:{'+'.join(t)}" for m, t, a in CASES])
def test_each_rank_holds_vllms_local_shard_bit_for_bit(child_results, case):
    res = child_results[case]
    assert res["names_equal"], res["extra"]
    assert not res["mismatch"], res["mismatch"]
    holders = [d for h in res["holders"] for d in h]
    assert len(holders) == len(set(holders)) == res["mesh_size"]  # every device holds exactly one rank
    assert res["o_proj_shard_shape"] == [1, 256, 512 // res["tp"]]  # the device keeps only its rank's columns


@pytest.mark.parametrize("case", [f"{a}:{m}:{'+'.join(t)}" for m, t, a in CASES])
def test_no_whole_tensor_gather(child_results, case):
    res = child_results[case]
    # the reshard moves at most one rank's part of a tensor per collective (the whole embedding, 1000 x 256,
    # would be larger than any rank-local output), and a trainer already in vLLM's layout communicates nothing
    # but the finiteness flags (scalars)
    assert max(res["collective_sizes"], default=0) <= res["max_local_size"], res["collective_sizes"]
    if case == "dense:tensor=2:tensor":  # only the embedding/lm_head rows that cross vLLM's padded vocab split
        cfg = _config("dense")
        moved = (-(-cfg.vocab_size // 64) * 64 - cfg.vocab_size) // 2 * cfg.hidden_size
        assert max(res["collective_sizes"], default=1) <= moved, res["collective_sizes"]


def test_bad_input_is_named(child_results):
    err = child_results["errors"]
    assert "model.layers.1.self_attn.qkv_proj.weight" in err["nan"] and "NaN or inf" in err["nan"]
    assert "each of the 8 ranks holds" in err["blocks"] and "128x128" in err["blocks"]


if __name__ == "__main__":
    print(json.dumps(_child()))
