#!/usr/bin/env python
"""Plan a run before it goes to a cluster: compile the train step and the rollout step for a mesh, no weights.

    python scripts/plan.py --gin_file=configs/paper/exp1_dense_w8a8.gin --mesh=fsdp=8 --micro_batch_size=8
    python scripts/plan.py --gin_file=configs/paper/exp2_moe_w8a8.gin --mesh=fsdp=8 --device_memory_gib=80 \\
        --seq_len=4096 --json=plan.json

Everything is abstract (``jax.ShapeDtypeStruct`` with the rules' ``NamedSharding``; the model built with
``nnx.eval_shape``): the step functions the trainer runs (:class:`fp8rl_jax.trainer.train_step.CompiledTrainStep`,
the embedded engine's generation program) are lowered and compiled ahead of time for the mesh, and XLA's
``compiled.memory_analysis()`` gives the per-device bytes of arguments, outputs and temporaries. Without enough
devices here, fake ones are made (``--xla_force_host_platform_device_count``, set by this script for itself).

The model comes from ``train.model``: an HF directory's ``config.json`` when it exists on this machine, else the
preset named by the path (``/models/Qwen3-8B-Base`` -> :mod:`fp8rl_jax.models.presets`).

What a CPU compile can and cannot tell about GPU memory: the argument and output sizes (parameters, optimizer state,
batch, KV cache: their shapes and shardings) are exact for any backend. The temporaries are XLA:CPU's buffer
assignment, which fuses differently from XLA:GPU (no cuDNN attention or Triton fusions, other rematerialization
choices), so ``temp`` is an estimate, usually within a small factor; the runtime's own overheads (CUDA context,
cuBLAS/cuDNN workspaces, allocator fragmentation, NCCL buffers: typically 1-3 GiB per GPU) are not counted, which is
why "fits" keeps ``--headroom_gib`` free. Exit status 2 with one line for a bad flag or config.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _ensure_devices(n: int) -> None:
    """Fake ``n`` host devices for this process (before JAX starts), unless a real platform has enough."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def _model_config(source: str):
    from fp8rl_jax.models.loading import PACKAGED_MODELS, load_model_config
    from fp8rl_jax.models.presets import preset_for

    if os.path.exists(source) or source in PACKAGED_MODELS:  # a checkpoint here, or a packaged one (quickstart)
        return load_model_config(source), source
    cfg = preset_for(source)
    if cfg is None:
        raise ValueError(f"train.model={source!r} is not on this machine and names no preset "
                         "(fp8rl_jax.models.presets: Qwen3-0.6B, Qwen3-8B, Qwen3-30B-A3B)")
    return cfg, f"preset for {os.path.basename(source)}"


def _abstract(tree, shardings):
    import jax

    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def plan_train_step(cfg, model_cfg, mesh, rows: int, prompt_len: int, response_len: int,
                    micro_batch_size: int | None, loss_config=None, remat_policy: str = "none",
                    scan_layers: bool = False) -> dict:
    """Compile the train step for ``mesh`` on abstract inputs; per-device bytes from ``memory_analysis()``."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from fp8rl_jax import objectives
    from fp8rl_jax.models.decoder import CausalLM
    from fp8rl_jax.models.loading import as_dtype
    from fp8rl_jax.parallel.rules import batch_sharding, optimizer_shardings, state_shardings
    from fp8rl_jax.trainer.loop import make_optimizer
    from fp8rl_jax.trainer.precision import apply_train_precision, compute_dtype, wrap_optimizer
    from fp8rl_jax.trainer.train_step import CompiledTrainStep, StepOptions

    def make():
        m = CausalLM(model_cfg, param_dtype=as_dtype(cfg.train_dtype), dtype=as_dtype(compute_dtype(cfg.train_precision)),
                     rngs=nnx.Rngs(0), remat_policy=remat_policy, scan_layers=scan_layers)
        apply_train_precision(m, cfg.train_precision, fp8_grad=cfg.fp8_train_grad)
        return m, nnx.Optimizer(m, wrap_optimizer(make_optimizer(cfg), cfg.train_precision), wrt=nnx.Param)

    model, optimizer = nnx.eval_shape(make)
    gd_m, st_m = nnx.split(model)
    gd_o, st_o = nnx.split(optimizer)
    sh_m = state_shardings(st_m, mesh)
    sh_o = optimizer_shardings(st_o, sh_m, mesh)
    t = response_len
    batch = {"prompt_ids": ((rows, prompt_len), jnp.int32), "prompt_mask": ((rows, prompt_len), jnp.bool_),
             "response_ids": ((rows, t), jnp.int32), "response_mask": ((rows, t), jnp.float32),
             "rollout_logprobs": ((rows, t), jnp.float32), "advantages": ((rows,), jnp.float32)}
    lead = micro_batch_size if (micro_batch_size and micro_batch_size < rows) else rows
    b_abs = {k: jax.ShapeDtypeStruct(s, d, sharding=batch_sharding(mesh, (lead,) + s[1:])) for k, (s, d) in batch.items()}
    opts = StepOptions(loss_config=loss_config or objectives.LossConfig(), temperature=cfg.temperature,
                       micro_batch_size=micro_batch_size, num_layers=model_cfg.num_hidden_layers)
    step = CompiledTrainStep(opts, mesh)
    in_sh = (sh_m, sh_o, {k: v.sharding for k, v in b_abs.items()})
    fn = step._compile(gd_m, gd_o, True, in_sh)
    compiled = fn.lower(_abstract(st_m, sh_m), _abstract(st_o, sh_o), b_abs).compile()
    return _memory(compiled)


def plan_rollout_step(cfg, model_cfg, mesh, rows: int, prompt_len: int, max_tokens: int) -> dict:
    """Compile the embedded engine's generation program (prefill + decode loop, KV cache) for ``mesh``."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from fp8rl_jax.fp8.kv_cache import kv_cache_storage_dtype, normalize_kv_cache_dtype
    from fp8rl_jax.models.decoder import CausalLM
    from fp8rl_jax.parallel.rules import batch_sharding, state_shardings
    from fp8rl_jax.rollout.engine import ENGINE_PRECISIONS, _generate

    linear, dtype, _ = ENGINE_PRECISIONS[cfg.rollout_precision]
    model = nnx.eval_shape(lambda: CausalLM(model_cfg, linear_precision=linear, param_dtype=dtype, dtype=dtype,
                                            rngs=nnx.Rngs(0)))
    gd, st = nnx.split(model)
    sh = state_shardings(st, mesh)
    kv = normalize_kv_cache_dtype(cfg.kv_cache_dtype)
    layers = model_cfg.num_hidden_layers
    scales = (jax.ShapeDtypeStruct((layers,), jnp.float32),) * 2 + (None,) if kv == "fp8_e4m3" else (None,) * 3
    ids = jax.ShapeDtypeStruct((rows, prompt_len), jnp.int32, sharding=batch_sharding(mesh, (rows, prompt_len)))
    mask = jax.ShapeDtypeStruct((rows, prompt_len), jnp.bool_, sharding=batch_sharding(mesh, (rows, prompt_len)))
    f32, i32 = jax.ShapeDtypeStruct((), jnp.float32), jax.ShapeDtypeStruct((), jnp.int32)
    lowered = _generate.trace(gd, _abstract(st, sh), ids, mask, jax.random.key(0), i32, f32, i32, f32,
                              jax.ShapeDtypeStruct((1,), jnp.int32), *scales, n=cfg.samples_per_prompt,
                              max_tokens=max_tokens, greedy=False, use_top_k=False, use_top_p=False, pad_token_id=0,
                              cache_dtype=kv_cache_storage_dtype(kv, dtype),
                              record_routing=any(model_cfg.is_sparse_layer(i) for i in range(layers))).lower()
    return _memory(lowered.compile())


def _memory(compiled) -> dict:
    m = compiled.memory_analysis()
    gib = 2**30
    out = {"arguments_GiB": m.argument_size_in_bytes / gib, "outputs_GiB": m.output_size_in_bytes / gib,
           "aliased_GiB": m.alias_size_in_bytes / gib, "temp_GiB": m.temp_size_in_bytes / gib}
    # donated inputs alias outputs: count them once
    out["total_GiB"] = out["arguments_GiB"] + out["outputs_GiB"] - out["aliased_GiB"] + out["temp_GiB"]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gin_file", action="append", default=[])
    p.add_argument("--gin_param", action="append", default=[])
    p.add_argument("--mesh", required=True, help="mesh shape, e.g. fsdp=8 or data=2,fsdp=4")
    p.add_argument("--device_memory_gib", type=float, default=80.0, help="per-device memory to fit (H100: 80)")
    p.add_argument("--headroom_gib", type=float, default=4.0, help="kept free for the runtime's own buffers")
    p.add_argument("--micro_batch_size", type=int, default=None, help="rows per micro-batch (train.micro_batch_size)")
    p.add_argument("--seq_len", type=int, default=None, help="response tokens to plan for (default train.max_tokens)")
    p.add_argument("--prompt_len", type=int, default=None, help="prompt tokens (default train.max_prompt_length)")
    p.add_argument("--rollout_rows", type=int, default=None,
                   help="prompts per generation program (the engine's chunk; default: all prompts of a step)")
    p.add_argument("--remat_policy", default=None,
                   help="train.remat_policy (none, full, dots_saveable, dots_with_no_batch_dims_saveable, ...)")
    p.add_argument("--scan_layers", action="store_true", help="train.scan_layers: layers under one lax.scan")
    p.add_argument("--skip_rollout", action="store_true")
    p.add_argument("--json", default=None, help="also write the result as JSON here")
    args = p.parse_args(argv)

    from fp8rl_jax.parallel.mesh import parse_mesh_shape

    try:
        shape = parse_mesh_shape(args.mesh)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    n_dev = 1
    for v in shape.values():
        n_dev *= v
    _ensure_devices(n_dev)

    from fp8rl_jax.trainer.cli import config_from_gin_flags

    args.output_dir = None
    cfg, error = config_from_gin_flags(args)
    if error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        model_cfg, source = _model_config(cfg.model)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from fp8rl_jax.parallel.mesh import make_mesh

    mesh = make_mesh(shape)
    rows = cfg.prompts_per_step * cfg.samples_per_prompt // cfg.num_minibatches
    prompt_len = args.prompt_len or cfg.max_prompt_length
    seq = args.seq_len or cfg.response_budget
    mbs = args.micro_batch_size if args.micro_batch_size is not None else cfg.micro_batch_size
    res = {"gin_files": args.gin_file, "mesh": args.mesh, "model": source, "rows": rows, "prompt_len": prompt_len,
           "response_len": seq, "micro_batch_size": mbs, "device_memory_gib": args.device_memory_gib,
           "platform": mesh.devices.flat[0].platform}
    remat = args.remat_policy or getattr(cfg, "remat_policy", "none")
    scan = args.scan_layers or bool(getattr(cfg, "scan_layers", False))
    res.update(remat_policy=remat, scan_layers=scan)
    res["train_step"] = plan_train_step(cfg, model_cfg, mesh, rows, prompt_len, seq, mbs, remat_policy=remat,
                                        scan_layers=scan)
    if not args.skip_rollout:
        rrows = args.rollout_rows or cfg.prompts_per_step
        res["rollout_rows"] = rrows
        res["rollout_step"] = plan_rollout_step(cfg, model_cfg, mesh, rrows, prompt_len, seq)
    budget = args.device_memory_gib - args.headroom_gib
    print(f"model {source}; mesh {args.mesh} ({n_dev} devices, {res['platform']}); train rows {rows} x "
          f"({prompt_len} + {seq}) tokens, micro_batch_size {mbs}, remat {remat}, scan_layers {scan}")
    print(f"{'step':<13}{'args GiB':>10}{'out GiB':>10}{'aliased':>10}{'temp GiB':>10}{'total GiB':>11}  fits "
          f"{args.device_memory_gib:g} GiB (- {args.headroom_gib:g})")
    for key in ("train_step", "rollout_step"):
        if key in res:
            m = res[key]
            m["fits"] = m["total_GiB"] <= budget
            print(f"{key:<13}{m['arguments_GiB']:>10.2f}{m['outputs_GiB']:>10.2f}{m['aliased_GiB']:>10.2f}"
                  f"{m['temp_GiB']:>10.2f}{m['total_GiB']:>11.2f}  {'yes' if m['fits'] else 'NO'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
