"""Expert parallelism (issue 38): the routed rows of each MoE layer go to their experts' owners by all-to-all and
back, dropless; results equal the ``expert = 1`` path.

Every multi-device check runs in its own subprocess with ``--xla_force_host_platform_device_count=8`` (this file run
as a script, one JSON line out), as tests/test_mesh.py does. References: the same block / model on one device with
the replicated dispatch (the path every earlier test checks against float64 and HF ``transformers``), and, for the
adversarial routings, a float64 numpy evaluation of the Qwen3-MoE block formula written here from the HF semantics.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))
#: meshes of the one-round comparisons (expert=2 runs in token rounds: ROUND_CASES)
MESHES = ("expert=8", "fsdp=2,expert=4")
#: meshes on which the ragged lowering's layout runs with an emulated ragged all-to-all
RAGGED_MESHES = ("fsdp=2,expert=4",)
#: token rounds (moe.chunk_tokens): (mesh, all-to-all lowering, tokens per round)
ROUND_CASES = (("expert=2", "static", 3), ("fsdp=2,expert=4", "ragged", 1))
E, K_TOP, HID, INTER = 8, 2, 64, 32
#: float32: only the grouped GEMM's tiling changes (which rows share a tile), so each output is the same sum in a
#: possibly different blocking of one dot: a few float32 roundings, far below 1e-6 relative
F32_RTOL = 1e-6
#: bf16 products round their float32 accumulators to bf16 (8 significant bits); a different summation order inside
#: the accumulator can flip that rounding by one unit: 2^-8 relative on g, u, then h = silu(g) u (two inputs,
#: 2 * 2^-8) and y = W_d h (one more rounding): |dy| <= (3 * 2^-8 + 2^-8) * max|y| per output, taken as 2^-6
BF16_RTOL = 2.0 ** -6


# ----------------------------------------------------------------------------------------------------------------
# float64 reference of the block (HF Qwen3MoeSparseMoeBlock semantics), independent of the package's code
# ----------------------------------------------------------------------------------------------------------------
def block_reference_f64(x, gate_w, wg, wu, wd, ids, norm_topk_prob=True):
    """``x [T, H]``, router ``gate_w [E, H]``, stacks ``wg/wu [E, I, H]``, ``wd [E, H, I]``, routed ``ids [T, k]``:
    ``sum_j p_j / sum(p) * W_d (silu(W_g x) * W_u x)`` with ``p = softmax(x gate_w^T)[ids]``, in float64."""
    x = np.asarray(x, np.float64)
    logits = x @ np.asarray(gate_w, np.float64).T
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    w = np.take_along_axis(p, ids, -1)
    if norm_topk_prob:
        w = w / w.sum(-1, keepdims=True)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j, e in enumerate(ids[t]):
            g = np.asarray(wg[e], np.float64) @ x[t]
            u = np.asarray(wu[e], np.float64) @ x[t]
            h = g / (1 + np.exp(-g)) * u
            out[t] += w[t, j] * (np.asarray(wd[e], np.float64) @ h)
    return out


# ----------------------------------------------------------------------------------------------------------------
# subprocess workers
# ----------------------------------------------------------------------------------------------------------------
def _block(precision="dense", dtype="float32", seed=0):
    import jax.numpy as jnp
    from flax import nnx

    from fp8rl_jax.models.moe import SparseMoeBlock, tiny_qwen3_moe_config

    cfg = tiny_qwen3_moe_config(256, hidden_size=HID, num_experts=E, num_experts_per_tok=K_TOP,
                                moe_intermediate_size=INTER)
    dt = jnp.dtype(dtype)
    blk = SparseMoeBlock(cfg, linear_precision="dense", param_dtype=dt, dtype=dt, rngs=nnx.Rngs(seed))
    if precision == "fp8":
        blk = _fp8_block(cfg, blk)
    return cfg, blk


def _fp8_block(cfg, dense):
    """The same block with e4m3 expert stacks (the package's blockwise quantizer; both sides of a comparison use
    the same stacks, so only the dispatch is under test)."""
    import jax.numpy as jnp
    from flax import nnx

    from fp8rl_jax.fp8 import quantize_weight_blockwise
    from fp8rl_jax.models.moe import SparseMoeBlock

    blk = SparseMoeBlock(cfg, linear_precision="fp8", param_dtype=jnp.bfloat16, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    blk.gate.weight[...] = dense.gate.weight[...].astype(jnp.bfloat16)
    for name in ("gate_proj", "up_proj", "down_proj"):
        src, dst = getattr(dense.experts, name), getattr(blk.experts, name)
        q = [quantize_weight_blockwise(w) for w in src.weight[...]]
        dst.weight[...] = jnp.stack([a for a, _ in q])
        dst.weight_scale_inv[...] = jnp.stack([s for _, s in q])
    return blk


def ragged_all_to_all_emulated(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                               axis_name):
    """:func:`jax.lax.ragged_all_to_all`'s documented semantics from all-gathers and selects (independent of the
    package): sender ``j`` writes ``operand_j[input_offsets_j[i] : + send_sizes_j[i]]`` into receiver ``i``'s
    ``output`` at ``output_offsets_j[i]``; ``recv_sizes`` is checked against what arrives."""
    import jax
    import jax.numpy as jnp

    me = jax.lax.axis_index(axis_name)
    ops = jax.lax.all_gather(operand, axis_name)
    ins, sends, outs = (jax.lax.all_gather(a, axis_name) for a in (input_offsets, send_sizes, output_offsets))
    rows = jnp.arange(output.shape[0])
    for j in range(ops.shape[0]):
        n, src, dst = sends[j, me], ins[j, me], outs[j, me]
        mask = (rows >= dst) & (rows < dst + n)
        idx = jnp.clip(rows - dst + src, 0, operand.shape[0] - 1)
        output = jnp.where(mask[:, None], ops[j][idx], output)
    bad = jnp.any(sends[:, me] != recv_sizes)
    return jnp.where(bad, jnp.nan, output)  # a wrong recv_sizes poisons the result


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30)) if b.size else 0.0


def _worker_blocks() -> dict:
    """The block forward and gradients on every mesh vs one device; adversarial routings vs float64."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from fp8rl_jax.models.moe import set_expert_parallel
    from fp8rl_jax.parallel import make_mesh

    assert len(jax.devices("cpu")) == 8
    out: dict = {}
    rng = np.random.default_rng(0)

    def fwd(m, x, rep):
        return m.forward(x, rep)[0]

    def loss(m, x, rep):
        y = fwd(m, x, rep)
        return jnp.sum(y.astype(jnp.float32) * jnp.cos(jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape)))

    def grads(m, x, rep):
        g_m, g_x = nnx.grad(loss, argnums=(0, 1))(m, x, rep)
        return {".".join(map(str, p)): v[...] for p, v in nnx.to_flat_state(g_m)} | {"x": g_x}

    fwd_jit, grads_jit = nnx.jit(fwd), nnx.jit(grads)  # one trace per (model settings, replay or not)
    cfg, blk = _block()
    x = jnp.asarray(rng.normal(size=(3, 5, HID)), jnp.float32)  # 15 tokens: not a multiple of 8 devices
    routings = {
        "router": None,
        "all_to_expert_0": np.stack([np.zeros(15), np.ones(15)], -1),      # device 0 receives every row
        "experts_without_tokens": np.stack([np.full(15, 5), np.full(15, 2)], -1),
        "reversed": np.stack([np.arange(15) % E, (np.arange(15) + 3) % E], -1),
    }
    ref = {}
    with jax.default_device(jax.devices("cpu")[0]):
        for name, ids in routings.items():
            rep = None if ids is None else jnp.asarray(ids.reshape(3, 5, K_TOP), jnp.int32)
            ref[name] = (np.asarray(fwd_jit(blk, x, rep)),
                         {k: np.asarray(v) for k, v in grads_jit(blk, x, rep).items()})
            if ids is not None:  # the replicated path itself against float64 (so both sides are anchored)
                ex = blk.experts
                f64 = block_reference_f64(np.asarray(x).reshape(15, HID), blk.gate.weight[...], ex.gate_proj.weight[...],
                                          ex.up_proj.weight[...], ex.down_proj.weight[...], ids.astype(np.int64))
                out[f"f64|{name}"] = _rel(ref[name][0].reshape(15, HID), f64)
    from fp8rl_jax.models import expert_parallel as epm

    epm.RAGGED_ALL_TO_ALL[0] = ragged_all_to_all_emulated  # the ragged layout, run on the CPU
    # every mesh in one round, then token rounds (moe.chunk_tokens): expert=2 gives each device 8 of the 16 padded
    # tokens, rounds of at most 3 make three rounds of 3, the last with one padding token (static buffers);
    # fsdp=2,expert=4 gives each device 2, rounds of 1 (the ragged layout, two token axes)
    cases = ([(s, "static", None) for s in MESHES] + [(s, "ragged", None) for s in RAGGED_MESHES]
             + list(ROUND_CASES))
    for shape, impl, chunk in cases:
        m = nnx.clone(blk)
        assert set_expert_parallel(m, make_mesh(shape, platform="cpu"), "all_to_all", all_to_all=impl,
                                   chunk_tokens=chunk)
        label = impl if chunk is None else f"{impl},chunk{chunk}"
        for name, ids in routings.items():
            rep = None if ids is None else jnp.asarray(ids.reshape(3, 5, K_TOP), jnp.int32)
            y = np.asarray(fwd_jit(m, x, rep))
            g = {k: np.asarray(v) for k, v in grads_jit(m, x, rep).items()}
            out[f"{shape}|{label}|{name}"] = {"y": _rel(y, ref[name][0]),
                                              "grad": max(_rel(g[k], ref[name][1][k]) for k in ref[name][1]),
                                              "grad_keys": sorted(g) == sorted(ref[name][1])}
    out["chunk_temp_bytes"] = _chunk_temp_bytes(blk)
    try:
        set_expert_parallel(nnx.clone(blk), make_mesh("expert=3", platform="cpu"))
        out["nondivisible_error"] = ""
    except ValueError as err:
        out["nondivisible_error"] = str(err)
    # one token on 8 devices (seven devices get only padding)
    mesh = make_mesh("expert=8", platform="cpu")
    m = nnx.clone(blk)
    set_expert_parallel(m, mesh)
    x1 = x[:1, :1]
    with jax.default_device(jax.devices("cpu")[0]):
        r1 = np.asarray(fwd_jit(blk, x1, None))
    out["one_token"] = _rel(np.asarray(fwd_jit(m, x1, None)), r1)
    # bf16 and FP8 experts: forward vs the replicated path on expert=4
    for prec, dtype in (("dense", "bfloat16"), ("fp8", "bfloat16")):
        _, b = _block(prec, dtype)
        with jax.default_device(jax.devices("cpu")[0]):
            r = np.asarray(fwd_jit(b, x.astype(dtype), None), np.float32)
        mb = nnx.clone(b)
        set_expert_parallel(mb, make_mesh("fsdp=2,expert=4", platform="cpu"))
        out[f"{prec}|{dtype}"] = _rel(np.asarray(fwd_jit(mb, x.astype(dtype), None), np.float32), r)
    return out


def _chunk_temp_bytes(blk, tokens_per_device: int = 256, chunk: int = 32) -> dict:
    """XLA:CPU's temporary bytes of the block's gradient program on ``expert=8`` (static buffers, whose send and
    receive blocks hold ``e * R`` rows), in one round and in rounds of ``chunk`` tokens."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from fp8rl_jax.models.moe import set_expert_parallel
    from fp8rl_jax.parallel import make_mesh

    mesh = make_mesh("expert=8", platform="cpu")
    x = jax.ShapeDtypeStruct((8 * tokens_per_device, HID), jnp.float32)
    out = {}
    for c in (0, chunk):
        m = nnx.clone(blk)
        set_expert_parallel(m, mesh, "all_to_all", all_to_all="static", chunk_tokens=c)
        gdef, state = nnx.split(m)

        def loss(st, x):
            return jnp.sum(nnx.merge(gdef, st).forward(x, None)[0] ** 2)

        comp = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(state, x).compile()
        out[str(c)] = int(comp.memory_analysis().temp_size_in_bytes)
    return out


def _moe_model_cfg():
    from fp8rl_jax.models.config import ModelConfig

    return ModelConfig(model_type="qwen3_moe", vocab_size=256, hidden_size=HID, intermediate_size=96,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       max_position_embeddings=256, rms_norm_eps=1e-6, eos_token_id=2, pad_token_id=0,
                       num_experts=E, num_experts_per_tok=K_TOP, moe_intermediate_size=INTER, norm_topk_prob=True,
                       qk_norm=True)


def _worker_model() -> dict:
    """A tiny Qwen3-MoE policy: loss and gradients (R3 replay on and off) on ``fsdp=2,expert=4`` with the
    all-to-all dispatch vs one device, and the compiled program's collectives."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from test_mesh import grads_dict, make_batch

    from fp8rl_jax.models.decoder import named_params
    from fp8rl_jax.models.loading import build_model
    from fp8rl_jax.models.moe import set_expert_parallel
    from fp8rl_jax.objectives import LossConfig
    from fp8rl_jax.parallel import make_mesh
    from fp8rl_jax.parallel.loading import build_sharded_model
    from fp8rl_jax.trainer.train_step import CompiledTrainStep, StepOptions, loss_and_grads

    cfg = _moe_model_cfg()
    out: dict = {}
    with jax.default_device(jax.devices("cpu")[0]):
        ref_model = build_model(cfg, None, seed=0)
        params = {k: np.asarray(v) for k, v in named_params(ref_model).items()}
        batch = make_batch(cfg, ref_model)
    rng = np.random.default_rng(1)
    rows, length = batch["prompt_ids"].shape[0], batch["prompt_ids"].shape[1] + batch["response_ids"].shape[1]
    routing = rng.integers(0, E, (rows, length, cfg.num_hidden_layers, K_TOP)).astype(np.int32)
    routing[..., 1] = (routing[..., 0] + 1 + rng.integers(0, E - 1, routing.shape[:-1])) % E  # distinct per token
    routing[0] = 0
    routing[0, ..., 1] = 1  # a whole row on experts 0 and 1 (one device's)
    batch["rollout_routing"] = routing
    moe_layers = tuple(range(cfg.num_hidden_layers))

    def grads_of(model, mesh, replay):
        opts = StepOptions(LossConfig(), 1.0, moe_layers=moe_layers, routing_replay=replay)
        b = {k: jnp.asarray(v) for k, v in batch.items()}
        if mesh is not None:
            b = jax.device_put(b, CompiledTrainStep(opts, mesh=mesh).batch_shardings(b))
        fn = nnx.jit(lambda m, bb: loss_and_grads(m, bb, opts, True)[:3])
        g, loss, metrics = fn(model, b)
        return grads_dict(g), float(loss), {k: float(v) for k, v in metrics.items()}, fn, b

    ref = {}
    with jax.default_device(jax.devices("cpu")[0]):
        for replay in (False, True):
            ref[replay] = grads_of(build_model(cfg, params), None, replay)[:3]
    mesh = make_mesh("fsdp=2,expert=4", platform="cpu")
    model, _ = build_sharded_model(cfg, params, mesh)
    assert set_expert_parallel(model, mesh)
    for replay in (False, True):
        g, loss, metrics, fn, b = grads_of(model, mesh, replay)
        rg = ref[replay][0]
        out[f"replay={replay}"] = {
            "loss": abs(loss - ref[replay][1]) / max(1.0, abs(ref[replay][1])),
            "grad": max(_rel(g[k], rg[k]) for k in rg),
            "metrics": max(abs(metrics[k] - ref[replay][2][k]) / max(1.0, abs(ref[replay][2][k])) for k in metrics),
            "replay_changes_loss": abs(ref[True][1] - ref[False][1]) > 1e-6 if replay else None}
    hlo = fn.lower(model, b).compile().as_text()
    stacks = {tuple(v[...].shape) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
              if "experts" in ".".join(map(str, p))}
    out["stack_shapes"] = sorted(stacks)
    out["hlo"] = _collectives(hlo, stacks)
    out["expert_leaf_local"] = sorted({tuple(s.data.shape) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
                                       if "experts" in ".".join(map(str, p))
                                       for s in v[...].addressable_shards[:1]})
    return out


def _collectives(hlo: str, stacks) -> dict:
    """Count the collectives of a compiled HLO module and list every all-gather whose result has a full expert
    stack's leading dimension ``E`` (``[E, N, K]``): there must be none under expert parallelism."""
    import re

    counts = {op: len(re.findall(rf"\b{op}(-start)?\(", hlo)) for op in
              ("all-to-all", "all-gather", "reduce-scatter", "all-reduce", "collective-permute")}
    gathers = re.findall(r"=\s*\(?([a-z0-9]+)\[([0-9,]*)\][^=]*?\ball-gather(?:-start)?\(", hlo)
    full = [f"{dt}[{dims}]" for dt, dims in gathers if dt[0] in "fb" and dims and int(dims.split(",")[0]) == E
            and dims.count(",") == 2]  # float (f32, bf16, f8e4m3fn) [E, ., .]: a stack gathered over ``expert``
    return {"counts": counts, "full_stack_gathers": full}


def _worker_trainer(model_dir: str, ckpt_dir: str) -> dict:
    """RLTrainer, 2 steps on ``fsdp=2,expert=4`` (expert-parallel; FP8 training, 2 micro-batches, scanned layers
    with full remat, FP8 rollout on the same mesh), checkpoint after step 1, restore it into the same trainer and redo
    step 2: same metrics and parameters. Plus the FP8 export on the mesh byte-equal to the unsharded one."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from test_mesh import flat_params

    from fp8rl_jax.export import export_weights
    from fp8rl_jax.trainer.checkpoint import CheckpointStore
    from fp8rl_jax.trainer.config import TrainConfig
    from fp8rl_jax.trainer.loop import RLTrainer

    common = dict(model=model_dir, num_steps=2, prompts_per_step=2, samples_per_prompt=4, max_tokens=8,
                  learning_rate=1e-3, adam_eps=1e-3, progress_bar=False, checkpoint_every=0, plots=False,
                  mismatch_action="off", verify_sync="first", mesh="fsdp=2,expert=4", rollout_precision="fp8",
                  # everywhere the block runs in training: FP8 training (the experts' tiled product with the FP8
                  # dot_general), micro-batches, layers under one scan with full remat
                  train_precision="fp8", micro_batch_size=4, scan_layers=True, remat_policy="full")
    tr = RLTrainer(TrainConfig(output_dir="/nonexistent", **common))
    out = {"engine_ep": bool(tr.engine.expert_parallel)}
    blocks = [m for _, m in __import__("flax").nnx.iter_modules(tr.model) if hasattr(m, "expert_parallel")]
    out["trainer_ep"] = all(b.expert_parallel is not None for b in blocks) and bool(blocks)
    m1 = tr.step()
    store = CheckpointStore(ckpt_dir, async_save=False)
    tr.save_checkpoint(store, force=True)
    m2 = tr.step()
    p2 = {k: np.array(v, copy=True) for k, v in flat_params(tr.model).items()}  # the same trainer steps again
    w_mesh = tr.export(fuse=False)
    w_host = export_weights(p2, "fp8_blockwise")
    out["export_equal"] = sorted(w_mesh.tensors) == sorted(w_host.tensors) and all(
        np.array_equal(np.asarray(w_mesh.tensors[k]).view(np.uint8), np.asarray(w_host.tensors[k]).view(np.uint8))
        for k in w_host.tensors)
    out["export_expert_tensors"] = sum(1 for k in w_host.tensors if ".experts." in k)
    out["export_diff"] = sorted(set(w_mesh.tensors) ^ set(w_host.tensors))[:4] + [
        k for k in sorted(w_host.tensors) if k in w_mesh.tensors and not np.array_equal(
            np.asarray(w_mesh.tensors[k]).view(np.uint8), np.asarray(w_host.tensors[k]).view(np.uint8))][:4]
    # resume in the same trainer (its compiled programs are reused: a second trainer costs ~1 min of compiles here;
    # a new process resuming is tests/test_checkpoint.py's): the parameters, AdamW moments, step and RNG all come
    # from the checkpoint onto the expert-sharded mesh, and step 2 is redone
    restored = tr.restore_checkpoint(store)
    m2b = tr.step()
    store.close()
    keys = [k for k in m2 if not k.startswith(("timing/", "sync/", "memory/"))]
    out["restored"] = restored
    out["resume_metric_diff"] = {k: (m2[k], m2b[k]) for k in keys if not (m2[k] == m2b[k] or (np.isnan(m2[k]) and np.isnan(m2b[k])))}
    p2b = flat_params(tr.model)
    out["resume_param_equal"] = all(np.array_equal(p2[k], p2b[k]) for k in p2)
    out["step1_finite"] = all(np.isfinite(v) for k, v in m1.items() if k.startswith("actor/"))
    return out


def _worker_ckpt(directory: str) -> dict:
    """An orbax checkpoint (params + AdamW state) saved under ``expert=8`` restores on one device, and one saved on
    one device restores under ``expert=8``: every value equal, the restored stacks sharded as the target asks."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from test_mesh import make_optimizer_for_test

    from fp8rl_jax.models.loading import build_model
    from fp8rl_jax.models.moe import set_expert_parallel
    from fp8rl_jax.parallel import make_mesh
    from fp8rl_jax.parallel.loading import build_sharded_model, shard_optimizer
    from fp8rl_jax.trainer.checkpoint import (CheckpointStore, load_model_state, load_optimizer_state, model_state,
                                              optimizer_state)

    cfg = _moe_model_cfg()
    mesh = make_mesh("expert=8", platform="cpu")
    cpu0 = jax.devices("cpu")[0]

    def sharded(seed):
        model, _ = build_sharded_model(cfg, None, mesh, seed=seed)
        set_expert_parallel(model, mesh)
        opt = nnx.Optimizer(model, make_optimizer_for_test(), wrt=nnx.Param)
        shard_optimizer(opt, model, mesh)
        return model, opt, mesh

    def single(seed):
        with jax.default_device(cpu0):
            model = build_model(cfg, None, seed=seed)
            return model, nnx.Optimizer(model, make_optimizer_for_test(), wrt=nnx.Param), None

    def flat(model, opt):
        st = {"params": model_state(model), "optimizer": optimizer_state(opt)}
        return {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(st)[0]}

    def perturb(opt, seed):
        """Random AdamW moments (as after some steps), so the optimizer's leaves are not all zeros."""
        rng = np.random.default_rng(seed)
        state = nnx.state(opt)
        nnx.update(opt, jax.tree.map(lambda v: (v + jnp.asarray(rng.normal(size=v.shape), v.dtype)).astype(v.dtype)
                                     if jnp.issubdtype(v.dtype, jnp.floating) and v.ndim else v, state))

    out = {}
    for name, (src, dst) in {"expert8_to_1": (sharded, single), "1_to_expert8": (single, sharded)}.items():
        model, opt, m = src(3)
        perturb(opt, 1)
        saved = {k: np.asarray(v) for k, v in flat(model, opt).items()}
        store = CheckpointStore(os.path.join(directory, name), async_save=False)
        store.save(1, {"params": model_state(model), "optimizer": optimizer_state(opt)}, {"rl_step": 1}, force=True)
        model2, opt2, m2 = dst(99)
        state, _ = store.restore(None, {"params": model_state(model2), "optimizer": optimizer_state(opt2)},
                                 items=("params", "optimizer"))
        store.close()
        load_model_state(model2, state["params"])
        load_optimizer_state(opt2, state["optimizer"])
        now = flat(model2, opt2)
        stack_devices = sorted({len(v.sharding.device_set) for k, v in now.items() if "experts" in k and v.ndim == 3})
        out[name] = {"mismatched": [k for k in saved if not np.array_equal(saved[k], np.asarray(now[k]))][:5],
                     "leaves": len(saved), "stack_devices": stack_devices,
                     "zero_leaves": [k for k, v in saved.items() if v.size > 1 and not np.any(v)][:5]}
    return out


def _run_worker(mode: str, *args: str, devices: int = 8, timeout: int = 900) -> dict:
    from conftest import run_worker_script

    return run_worker_script(HERE, mode, *args, devices=devices, timeout=timeout)


# ----------------------------------------------------------------------------------------------------------------
# tests
# ----------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def blocks():
    return _run_worker("blocks")


@pytest.mark.parametrize("shape,impl", [(s, "static") for s in MESHES] + [(s, "ragged") for s in RAGGED_MESHES])
@pytest.mark.parametrize("routing", ["router", "all_to_expert_0", "experts_without_tokens", "reversed"])
def test_block_forward_and_gradients_equal_one_device(blocks, shape, impl, routing):
    got = blocks[f"{shape}|{impl}|{routing}"]
    assert got["grad_keys"], got
    assert got["y"] <= F32_RTOL and got["grad"] <= F32_RTOL, got


def test_replicated_block_matches_float64_at_the_adversarial_routings(blocks):
    """Anchors the reference side: the one-device block equals the float64 formula for forced routings."""
    for name in ("all_to_expert_0", "experts_without_tokens", "reversed"):
        assert blocks[f"f64|{name}"] <= 1e-5, (name, blocks[f"f64|{name}"])


@pytest.mark.parametrize("shape,impl,chunk", ROUND_CASES)
@pytest.mark.parametrize("routing", ["router", "all_to_expert_0", "experts_without_tokens", "reversed"])
def test_token_rounds_equal_one_device(blocks, shape, impl, chunk, routing):
    """moe.chunk_tokens: the layer in rounds (expert=2: 8 tokens per device in 3 rounds of 3, the last padded;
    fsdp=2,expert=4 ragged: 2 rounds of 1) equals one device."""
    got = blocks[f"{shape}|{impl},chunk{chunk}|{routing}"]
    assert got["grad_keys"], got
    assert got["y"] <= F32_RTOL and got["grad"] <= F32_RTOL, got


def test_token_rounds_bound_the_dispatch_memory(blocks):
    """256 tokens per device on expert=8 (top-2: 512 rows, static buffers of 8 x 512 rows): rounds of 32 tokens
    cut the gradient program's temporaries by at least 4x (the buffers alone shrink 8x)."""
    t = blocks["chunk_temp_bytes"]
    assert t["32"] * 4 <= t["0"], t


def test_one_token_on_eight_devices(blocks):
    assert blocks["one_token"] <= F32_RTOL, blocks["one_token"]


def test_expert_axis_must_divide_the_experts(blocks):
    assert "8 experts over expert=3" in blocks["nondivisible_error"], blocks["nondivisible_error"]


def test_bf16_and_fp8_experts_within_their_bound(blocks):
    assert blocks["dense|bfloat16"] <= BF16_RTOL, blocks
    # FP8: the activations are quantized per row (1x128 groups), the weights are the same e4m3 blocks and the
    # products accumulate in float32 before the bf16 output: the bf16 bound applies unchanged
    assert blocks["fp8|bfloat16"] <= BF16_RTOL, blocks


@pytest.fixture(scope="module")
def model_run():
    return _run_worker("model")


@pytest.mark.parametrize("replay", [False, True])
def test_policy_loss_and_gradients_with_expert_parallelism(model_run, replay):
    got = model_run[f"replay={replay}"]
    assert got["loss"] <= 1e-6 and got["metrics"] <= 1e-5, got
    assert got["grad"] <= 1e-5, got
    if replay:
        assert got["replay_changes_loss"], "the replayed routes were not used"


def test_program_has_all_to_all_and_no_gather_of_an_expert_stack(model_run):
    hlo = model_run["hlo"]
    assert hlo["counts"]["all-to-all"] >= 4, hlo  # dispatch + return, per MoE layer (x2 layers), fwd and bwd
    assert hlo["full_stack_gathers"] == [], hlo
    assert all(s[0] == E // 4 for s in model_run["expert_leaf_local"]), model_run["expert_leaf_local"]


def test_trainer_on_fsdp_x_expert_trains_checkpoints_and_resumes_exactly(tmp_path):
    from fp8rl_jax.models.moe import write_tiny_qwen3_moe

    d = str(tmp_path / "moe")
    write_tiny_qwen3_moe(d, num_experts=E, num_experts_per_tok=K_TOP, hidden_size=128, moe_intermediate_size=128)
    got = _run_worker("trainer", d, str(tmp_path / "ckpt"))
    assert got["engine_ep"] and got["trainer_ep"], got
    assert got["step1_finite"], got
    assert got["restored"] == 1, got
    assert got["resume_metric_diff"] == {} and got["resume_param_equal"], got
    assert got["export_equal"] and got["export_expert_tensors"] > 0, got


def test_checkpoint_moves_between_expert_8_and_one_device(tmp_path):
    got = _run_worker("ckpt", str(tmp_path))
    for name, res in got.items():
        assert res["mismatched"] == [] and res["leaves"] > 20 and res["zero_leaves"] == [], (name, res)
    assert got["expert8_to_1"]["stack_devices"] == [1]
    assert got["1_to_expert8"]["stack_devices"] == [8]


def test_expert_parallel_settings_errors():
    import jax

    from fp8rl_jax.models.expert_parallel import capacities, expert_parallel
    from fp8rl_jax.parallel.moe_dispatch import MoeDispatchConfig

    mesh = jax.make_mesh((1, 1, 1, 1), ("data", "fsdp", "tensor", "expert"))
    assert expert_parallel(mesh, 8) is None  # expert axis of size 1: replicated
    with pytest.raises(ValueError, match="dispatch"):
        MoeDispatchConfig(dispatch="a2a")
    with pytest.raises(ValueError, match="all_to_all"):
        MoeDispatchConfig(all_to_all="nccl")
    with pytest.raises(ValueError, match="increasing"):
        MoeDispatchConfig(capacity_factors=(2.0, 1.0))
    with pytest.raises(ValueError, match="chunk_tokens"):
        MoeDispatchConfig(chunk_tokens=-1)
    with pytest.raises(ValueError, match="chunk_tokens"):
        expert_parallel(jax.make_mesh((1, 1, 1, 1), ("data", "fsdp", "tensor", "expert")), 8, chunk_tokens=2.5)
    assert capacities(10, 4, (1.25, 2.0)) == (13, 20, 40)
    assert capacities(10, 2, (1.25, 2.0)) == (13, 20)
    assert capacities(0, 4, (1.25,)) == (0,)


_CUDA_COMPILE = r"""
import json, re
import jax, jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P
from fp8rl_jax.gpu_target import h100_topology
from fp8rl_jax.parallel.mesh import make_mesh
from fp8rl_jax.models.moe import SparseMoeBlock, set_expert_parallel, tiny_qwen3_moe_config

mesh = make_mesh("expert=8", devices=h100_topology(8).devices)
cfg = tiny_qwen3_moe_config(256, hidden_size=256, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=128)
out = {}
for name, prec, chunk in (("dense", "dense", None), ("fp8", "fp8", None), ("dense_rounds", "dense", 4)):
    blk = nnx.eval_shape(lambda: SparseMoeBlock(cfg, linear_precision=prec, param_dtype=jnp.bfloat16,
                                                dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    set_expert_parallel(blk, mesh, chunk_tokens=chunk)  # rounds of 4 of the 8 tokens per device: a scan of 2
    gdef, state = nnx.split(blk)
    def shard(path, v):
        spec = P("expert") if "experts" in ".".join(map(str, path)) else P()
        return jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, spec))
    state = nnx.map_state(shard, state)
    x = jax.ShapeDtypeStruct((64, 256), jnp.bfloat16, sharding=NamedSharding(mesh, P("expert")))
    def loss(st, x):
        return jnp.sum(nnx.merge(gdef, st)(x).astype(jnp.float32) ** 2)
    fn = jax.grad(loss, argnums=(0, 1)) if prec == "dense" else loss
    hlo = jax.jit(fn).lower(state, x).compile().as_text()
    out[name] = {op: len(re.findall(rf"\b{op}(-start)?\(", hlo)) for op in ("ragged-all-to-all", "all-to-all", "all-gather")}
    out[name]["while_loops"] = len(re.findall(r"\bwhile\(", hlo))
    gathers = re.findall(r"=\s*\(?([a-z0-9]+)\[([0-9,]*)\][^=]*?\ball-gather(?:-start)?\(", hlo)
    out[name]["full_stack_gathers"] = [f"{d}[{s}]" for d, s in gathers if d[0] in "fb" and s and s.split(",")[0] == "16"]
print(json.dumps(out))
"""


def test_ragged_all_to_all_dispatch_compiles_for_h100():
    """Deviceless sm_90a compile in .venv-cuda (8 abstract H100s, ``expert=8``): the CUDA lowering of the dispatch
    is ``ragged-all-to-all`` (forward and, for bf16, the backward's transposes), the FP8 experts compile inside it,
    token rounds compile as a loop around it, and no expert stack is gathered over ``expert``."""
    from conftest import run_in_cuda_venv

    res = run_in_cuda_venv(_CUDA_COMPILE)
    assert res["dense"]["ragged-all-to-all"] >= 4, res  # dispatch + return forward, their transposes backward
    assert res["fp8"]["ragged-all-to-all"] >= 2, res
    assert res["dense"]["full_stack_gathers"] == [] and res["fp8"]["full_stack_gathers"] == [], res
    # token rounds (moe.chunk_tokens) lower for CUDA as a loop around the same ragged dispatch, forward and backward
    assert res["dense_rounds"]["ragged-all-to-all"] >= 4, res
    assert res["dense_rounds"]["while_loops"] > res["dense"]["while_loops"], res  # the rounds' loops
    assert res["dense_rounds"]["full_stack_gathers"] == [], res


if __name__ == "__main__":
    _mode, *_args = sys.argv[1:]
    sys.path.insert(0, ROOT)
    _fn = {"blocks": _worker_blocks, "model": _worker_model, "trainer": _worker_trainer, "ckpt": _worker_ckpt}
    print(json.dumps(_fn[_mode](*_args)))
