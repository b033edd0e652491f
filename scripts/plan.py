#!/usr/bin/env python
r"""Plan a run before it goes to a cluster: compile the train step and the rollout step for a mesh, no weights.

    python scripts/plan.py --gin_file=configs/paper/exp1_dense_w8a8.gin --mesh=fsdp=8 --micro_batch_size=8
    python scripts/plan.py --gin_file=configs/paper/exp2_moe_w8a8.gin --mesh=fsdp=8 --device_memory_gib=80 \
        --seq_len=4096 --json=plan.json

Everything is abstract (``jax.ShapeDtypeStruct`` with the rules' ``NamedSharding``; the model built with
``nnx.eval_shape``): the step functions the trainer runs (:class:`fp8rl_jax.trainer.train_step.CompiledTrainStep`,
the embedded engine's generation program) are lowered and compiled ahead of time for the mesh, and XLA's
``compiled.memory_analysis()`` gives the per-device bytes of arguments, outputs and temporaries. Without enough
devices here, fake ones are made (``--xla_force_host_platform_device_count``, set by this script for itself).

The model comes from ``train.model``: an HF directory's ``config.json`` when it exists on this machine (or, for a hub
name such as ``Qwen/Qwen3-8B``, in a local Hugging Face cache: docs/ASSETS.md), else the preset named by the path (``/models/Qwen3-8B-Base`` -> :mod:`fp8rl_jax.models.presets`). The gin flags are those of
scripts/train.py (every namespace: ``train``, ``LossConfig``, ``RolloutCorrectionConfig``, ``mesh``, the datasets,
...); ``python scripts/train.py --print_config`` lists every bindable parameter with its default.

What a CPU compile can and cannot tell about GPU memory: the argument and output sizes (parameters, optimizer state,
batch, KV cache: their shapes and shardings) are exact for any backend. The temporaries are XLA:CPU's buffer
assignment, which fuses differently from XLA:GPU (no cuDNN attention or Triton fusions, other rematerialization
choices), so ``temp`` is an estimate, usually within a small factor; the runtime's own overheads (CUDA context,
cuBLAS/cuDNN workspaces, allocator fragmentation, NCCL buffers: typically 1-3 GiB per GPU) are not counted, which is
why "fits" keeps ``--headroom_gib`` free. Exit status 2 with one line for a bad flag or config, 1 when a step does
not compile (its error's lines printed; the other step is still planned).

``--target=h100`` compiles the same programs with XLA:GPU for sm_90a on abstract H100s instead (no GPU needed: the
CUDA plugin's deviceless compile, :mod:`fp8rl_jax.gpu_target`; run it with ``.venv-cuda/bin/python``, built by
``make setup-cuda``). Its ``temp`` is XLA:GPU's own buffer assignment for the H100 program: its fusions, the
kernels the program picks when lowered for CUDA (cuDNN flash attention, Pallas kernels), its collectives. What it
still cannot know: the sizes autotuning would pick on a real device (a deviceless compile does not autotune) and the
runtime's own overheads (hence the headroom, as above).

    .venv-cuda/bin/python scripts/plan.py --target=h100 --gin_file=configs/paper/exp1_dense_w8a8.gin --mesh=fsdp=8 \
        --micro_batch_size=8 --rollout_rows=8 --remat_policy=full --scan_layers
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, ROOT)


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
    from fp8rl_jax.assets import HFCacheMissError, parse_hub_id

    if parse_hub_id(source) is not None:  # "Qwen/Qwen3-8B": its config from a local Hugging Face cache, if there
        try:
            return load_model_config(source), source
        except HFCacheMissError:
            pass  # not cached here: the preset of that name
    cfg = preset_for(source)
    if cfg is None:
        raise ValueError(f"train.model={source!r} is not on this machine and names no preset "
                         "(fp8rl_jax.models.presets: Qwen3-0.6B, Qwen3-8B, Qwen3-30B-A3B)")
    return cfg, f"preset for {os.path.basename(source)}"


def _abstract(tree, shardings):
    import jax

    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def train_step_program(cfg, model_cfg, mesh, rows: int, prompt_len: int, response_len: int,
                       micro_batch_size: int | None, loss_config=None, remat_policy: str = "none",
                       scan_layers: bool = False):
    """The trainer's compiled train step for ``mesh`` and its abstract arguments, nothing allocated.

    Args:
      cfg: :class:`fp8rl_jax.trainer.TrainConfig` (``train_dtype``, ``train_precision``, ``fp8_train_grad``,
        ``attention_implementation``, ``expert_impl``, ``temperature`` and the optimizer settings are read, and
        applied to the model as :class:`fp8rl_jax.trainer.RLTrainer` does:
        :func:`fp8rl_jax.trainer.model_setup.configure_train_model`).
      model_cfg: :class:`fp8rl_jax.models.config.ModelConfig`.
      mesh: a ``jax.sharding.Mesh`` with the project's axes (:func:`fp8rl_jax.parallel.mesh.make_mesh`), of CPU
        devices or of abstract H100s (:func:`fp8rl_jax.gpu_target.h100_topology`).
      rows, prompt_len, response_len: the minibatch: rows x (prompt + response) tokens.
      micro_batch_size: rows per micro-batch (None: the whole minibatch at once).
      loss_config: :class:`fp8rl_jax.objectives.LossConfig` (default one).
      remat_policy, scan_layers: :class:`fp8rl_jax.models.decoder.CausalLM`'s memory knobs.

    Returns:
      ``(fn, args)``: the jitted step (``CompiledTrainStep``'s, buffers donated, in-shardings from
      :mod:`fp8rl_jax.parallel.rules`) and ``(model state, optimizer state, batch)`` as ``ShapeDtypeStruct`` s
      placed on ``mesh``.
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from fp8rl_jax import objectives
    from fp8rl_jax.models.decoder import CausalLM
    from fp8rl_jax.models.loading import as_dtype
    from fp8rl_jax.parallel.rules import batch_sharding, optimizer_shardings, state_shardings
    from fp8rl_jax.trainer.loop import make_optimizer
    from fp8rl_jax.trainer.model_setup import configure_train_model
    from fp8rl_jax.trainer.precision import compute_dtype, wrap_optimizer
    from fp8rl_jax.trainer.train_step import CompiledTrainStep, StepOptions

    def make():
        m = CausalLM(model_cfg, param_dtype=as_dtype(cfg.train_dtype), dtype=as_dtype(compute_dtype(cfg.train_precision)),
                     rngs=nnx.Rngs(0), remat_policy=remat_policy, scan_layers=scan_layers)
        configure_train_model(m, cfg, model_cfg, mesh)  # attention, experts, precision: as RLTrainer does
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
    if loss_config is not None and getattr(loss_config, "use_kl_loss", False):  # the reference's logprobs (KL term)
        batch["ref_logprobs"] = ((rows, t), jnp.float32)
    lead = micro_batch_size if (micro_batch_size and micro_batch_size < rows) else rows
    b_abs = {k: jax.ShapeDtypeStruct(s, d, sharding=batch_sharding(mesh, (lead,) + s[1:])) for k, (s, d) in batch.items()}
    opts = StepOptions(loss_config=loss_config or objectives.LossConfig(), temperature=cfg.temperature,
                       micro_batch_size=micro_batch_size, num_layers=model_cfg.num_hidden_layers)
    step = CompiledTrainStep(opts, mesh)
    in_sh = (sh_m, sh_o, {k: v.sharding for k, v in b_abs.items()})
    fn = step._compile(gd_m, gd_o, True, in_sh)
    return fn, (_abstract(st_m, sh_m), _abstract(st_o, sh_o), b_abs)


def generate_program(model_cfg, mesh, precision: str, kv_cache_dtype: str, rows: int, prompt_len: int,
                     max_tokens: int, n: int = 1, fuse_projections: bool = False, kv_attention: str | None = None,
                     expert_impl: str = "auto"):
    """The embedded engine's generation program (``rollout.engine._generate``: prefill + ``while_loop`` decode with
    a preallocated KV cache) and its abstract arguments, as :class:`~fp8rl_jax.rollout.engine.JaxRolloutEngine`
    runs it, nothing allocated.

    Args:
      model_cfg: :class:`fp8rl_jax.models.config.ModelConfig`.
      mesh: the mesh the weights and prompts are placed on (rules of :mod:`fp8rl_jax.parallel.rules`).
      precision: ``"fp8"`` / ``"bf16"`` / ``"float32"`` (:data:`~fp8rl_jax.rollout.engine.ENGINE_PRECISIONS`).
      kv_cache_dtype: ``"auto"`` or ``"fp8_e4m3"`` (the cache then takes per-layer ``k_scale`` / ``v_scale``).
      rows, prompt_len: prompts per program and their (padded) length; ``n`` samples each.
      max_tokens: decode steps (the loop body compiles the same for any value).
      fuse_projections: the engine's fused ``qkv_proj`` / ``gate_up_proj`` (an FP8 engine on one device:
        :func:`~fp8rl_jax.rollout.engine.engine_fuses_projections`).
      kv_attention: the engine's ``kv_attention`` setting for every attention module (None: the module default).
      expert_impl: Qwen3-MoE experts (:func:`fp8rl_jax.models.moe.set_expert_impl`), as the engine's ``expert_impl``.

    Returns:
      ``(fn, args, static_kwargs)`` for ``fn.trace(*args, **static_kwargs)``.
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from fp8rl_jax.fp8.kv_cache import kv_cache_storage_dtype, normalize_kv_cache_dtype
    from fp8rl_jax.models.decoder import CausalLM
    from fp8rl_jax.models.loading import as_dtype
    from fp8rl_jax.parallel.rules import batch_sharding, state_shardings
    from fp8rl_jax.rollout.engine import ENGINE_PRECISIONS, _generate, configure_engine_model

    linear, dtype, _ = ENGINE_PRECISIONS[precision]
    dtype = as_dtype(dtype)
    model = nnx.eval_shape(lambda: CausalLM(model_cfg, linear_precision=linear, param_dtype=dtype, dtype=dtype,
                                            rngs=nnx.Rngs(0), fuse_projections=fuse_projections))
    configure_engine_model(model, kv_attention, expert_impl)
    gd, st = nnx.split(model)
    sh = state_shardings(st, mesh)
    kv = normalize_kv_cache_dtype(kv_cache_dtype)
    layers = model_cfg.num_hidden_layers
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def s(shape, dt, sharding=rep):
        return jax.ShapeDtypeStruct(shape, dt, sharding=sharding)

    scales = (s((layers,), jnp.float32),) * 2 + (None,) if kv == "fp8_e4m3" else (None,) * 3
    ids = s((rows, prompt_len), jnp.int32, batch_sharding(mesh, (rows, prompt_len)))
    mask = s((rows, prompt_len), jnp.bool_, batch_sharding(mesh, (rows, prompt_len)))
    key = s((), jax.eval_shape(lambda: jax.random.key(0)).dtype)
    args = (gd, _abstract(st, sh), ids, mask, key, s((), jnp.int32), s((), jnp.float32), s((), jnp.int32),
            s((), jnp.float32), s((1,), jnp.int32), *scales)
    kwargs = dict(n=n, max_tokens=max_tokens, greedy=False, use_top_k=False, use_top_p=False, pad_token_id=0,
                  cache_dtype=kv_cache_storage_dtype(kv, dtype),
                  record_routing=any(model_cfg.is_sparse_layer(i) for i in range(layers)))
    return _generate, args, kwargs


def _compile(fn, args, kwargs, target: str, mesh) -> tuple[Any, float]:
    """``(compiled, seconds)``: XLA:CPU (``target="cpu"``, the mesh's own devices) or XLA:GPU for sm_90a
    (``"h100"``, :func:`fp8rl_jax.gpu_target.compile_for_h100` on the mesh's abstract H100s)."""
    t0 = time.perf_counter()
    if target == "h100":
        from fp8rl_jax.gpu_target import compile_for_h100

        r = compile_for_h100(fn, *args, mesh=mesh, **kwargs)
        return r.compiled, r.compile_s
    compiled = fn.trace(*args, **kwargs).lower().compile()
    return compiled, time.perf_counter() - t0


def plan_train_step(cfg, model_cfg, mesh, rows: int, prompt_len: int, response_len: int,
                    micro_batch_size: int | None, loss_config=None, remat_policy: str = "none",
                    scan_layers: bool = False, target: str = "cpu") -> dict:
    """Compile the train step for ``mesh`` on abstract inputs; per-device bytes from ``memory_analysis()``
    (GiB; ``compile_s``: seconds to trace, lower and compile)."""
    fn, args = train_step_program(cfg, model_cfg, mesh, rows, prompt_len, response_len, micro_batch_size,
                                  loss_config=loss_config, remat_policy=remat_policy, scan_layers=scan_layers)
    compiled, secs = _compile(fn, args, {}, target, mesh)
    return dict(_memory(compiled), compile_s=round(secs, 1))


def plan_rollout_step(cfg, model_cfg, mesh, rows: int, prompt_len: int, max_tokens: int,
                      target: str = "cpu") -> dict:
    """Compile the embedded engine's generation program (prefill + decode loop, KV cache) for ``mesh``."""
    # the trainer's engine on its mesh: unfused projections, the materialized e4m3-cache attention
    # (JaxRolloutEngine with mesh=...)
    fn, args, kwargs = generate_program(model_cfg, mesh, cfg.rollout_precision, cfg.kv_cache_dtype, rows,
                                        prompt_len, max_tokens, n=cfg.samples_per_prompt, kv_attention="materialize",
                                        expert_impl=cfg.expert_impl)
    compiled, secs = _compile(fn, args, kwargs, target, mesh)
    return dict(_memory(compiled), compile_s=round(secs, 1))


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
    p.add_argument("--target", choices=("cpu", "h100"), default="cpu",
                   help="cpu: XLA:CPU on fake host devices (default); h100: XLA:GPU's deviceless compile for sm_90a on "
                        "abstract H100s (needs .venv-cuda: make setup-cuda)")
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
    devices = None
    if args.target == "h100":
        from fp8rl_jax.gpu_target import CudaPluginMissing, h100_topology

        try:
            devices = h100_topology(n_dev).devices
        except CudaPluginMissing as e:
            print(f"error: --target=h100: {e}", file=sys.stderr)
            return 2
    else:
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

    mesh = make_mesh(shape, devices=devices)
    rows = cfg.prompts_per_step * cfg.samples_per_prompt // cfg.num_minibatches
    prompt_len = args.prompt_len or cfg.max_prompt_length
    seq = args.seq_len or cfg.response_budget
    mbs = args.micro_batch_size if args.micro_batch_size is not None else cfg.micro_batch_size
    res = {"command": " ".join(["python scripts/plan.py", *(sys.argv[1:] if argv is None else argv)]),
           "gin_files": args.gin_file, "gin_params": args.gin_param, "mesh": args.mesh,
           "model": source, "rows": rows, "prompt_len": prompt_len,
           "response_len": seq, "micro_batch_size": mbs, "device_memory_gib": args.device_memory_gib,
           "platform": mesh.devices.flat[0].platform, "target": args.target}
    if args.target == "h100":
        from fp8rl_jax.gpu_target import TARGET_DESCRIPTION

        res["platform"] = TARGET_DESCRIPTION
    remat = args.remat_policy or getattr(cfg, "remat_policy", "none")
    scan = args.scan_layers or bool(getattr(cfg, "scan_layers", False))
    res.update(remat_policy=remat, scan_layers=scan)
    steps = {"train_step": lambda: plan_train_step(cfg, model_cfg, mesh, rows, prompt_len, seq, mbs,
                                                   remat_policy=remat, scan_layers=scan, target=args.target)}
    if not args.skip_rollout:
        rrows = args.rollout_rows or cfg.prompts_per_step
        res["rollout_rows"] = rrows
        steps["rollout_step"] = lambda: plan_rollout_step(cfg, model_cfg, mesh, rrows, prompt_len, seq,
                                                          target=args.target)
    failed = []
    for key, run in steps.items():  # a step that does not compile is reported; the other is still planned
        try:
            res[key] = run()
        except Exception as e:
            from fp8rl_jax.gpu_dump import compile_error_summary

            res[key] = {"failed": True, "error": compile_error_summary(e).replace(ROOT + os.sep, "")}
            failed.append(key)
            print(f"error: {key} does not compile for {res['platform']}:\n  "
                  + "\n  ".join(res[key]["error"].splitlines()), file=sys.stderr)
    budget = args.device_memory_gib - args.headroom_gib
    print(f"model {source}; mesh {args.mesh} ({n_dev} devices, {res['platform']}); train rows {rows} x "
          f"({prompt_len} + {seq}) tokens, micro_batch_size {mbs}, remat {remat}, scan_layers {scan}")
    print(f"{'step':<13}{'args GiB':>10}{'out GiB':>10}{'aliased':>10}{'temp GiB':>10}{'total GiB':>11}  fits "
          f"{args.device_memory_gib:g} GiB (- {args.headroom_gib:g})")
    for key in ("train_step", "rollout_step"):
        if key in res and res[key].get("failed"):
            print(f"{key:<13}{'does not compile (see the error above)':>51}")
        elif key in res:
            m = res[key]
            m["fits"] = m["total_GiB"] <= budget
            print(f"{key:<13}{m['arguments_GiB']:>10.2f}{m['outputs_GiB']:>10.2f}{m['aliased_GiB']:>10.2f}"
                  f"{m['temp_GiB']:>10.2f}{m['total_GiB']:>11.2f}  {'yes' if m['fits'] else 'NO'}"
                  f"  (compiled in {m['compile_s']:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
