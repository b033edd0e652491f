#!/usr/bin/env python
r"""Launch GRPO on Ray: one trainer actor (JAX) + N rollout actors (vLLM or the embedded engine).

    # one machine (starts a local Ray cluster; token-auth secret kept under --ray_temp_dir)
    python scripts/launch_ray.py --gin_file=configs/quickstart.gin --num_rollout_actors=1 --output_dir=runs/ray

    # an existing cluster (run on the head node after `ray start --head`, workers `ray start --address=HEAD:6379`);
    # a paper config runs the vLLM rollout actors its train.rollout_engine = "vllm" asks for
    python scripts/launch_ray.py --address=auto --gin_file=configs/paper/exp1_dense_w8a8.gin \
        --num_rollout_actors=4 --transport=dist --output_dir=runs/exp1

    # multi-host training: one JAX process per node (jax.distributed, coordinator on the first node), each with a
    # colocated rollout engine; the train step runs SPMD over a mesh spanning all of them
    python scripts/launch_ray.py --address=auto --num_trainer_processes=2 --spread --gpus_per_actor=8 \
        --gin_file=configs/paper/exp1_dense_w8a8.gin --gin_param='train.mesh="data=2,fsdp=8"' --output_dir=runs/mh

Gin is the one source of settings. Each flag below sets one gin binding and only when given: --rollout_engine is
train.rollout_engine, the others are ray_launch.<flag name> (ray_launch.num_rollout_actors, ...). A flag that
contradicts a binding of the gin files / --gin_param is an error naming both. The rollout engine is the config's
train.rollout_engine ("jax" by default, "vllm" in configs/paper/). Without --gpus_per_actor (and
ray_launch.gpus_per_actor) the actors get the GPUs the cluster has, split evenly over the trainer and the rollout
actors; --gpus_per_actor=0 keeps them on CPUs.

Weights go from the trainer to the rollout actors every step over --transport: shm (shared-memory buckets / CUDA
IPC; all actors on one node) or dist (torch.distributed broadcast, gloo or NCCL; any nodes). The gin bindings are
re-applied inside the trainer actor. `--print_config` prints every bindable parameter of every namespace (train,
LossConfig, RolloutCorrectionConfig, ray_launch, distributed, mesh, the datasets, ...) with its default. Exit
status 2 with a one-line message for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fp8rl_jax.trainer.cli import (  # noqa: E402
    add_gin_flags, bindable_config_text, config_from_gin_flags, error_line, fail, missing_path_error, parse_gin_flags)
from fp8rl_jax.trainer.launch import FLAG_BINDINGS  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    """The launcher's flags; every run setting defaults to None (not given: the gin binding or its default)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_gin_flags(p)
    p.add_argument("--address", default=None, help="existing Ray cluster ('auto', 'ray://head:10001'); "
                                                   "default: start a local one")
    p.add_argument("--num_rollout_actors", type=int, default=None,
                   help="rollout actors (ray_launch.num_rollout_actors, default 1)")
    p.add_argument("--num_trainer_processes", type=int, default=None,
                   help="> 1: multi-host trainer, one JAX process per bundle with its own rollout engine "
                        "(no rollout actors; ray_launch.num_trainer_processes, default 1)")
    p.add_argument("--spread", action="store_true", default=None,
                   help="multi-host: one trainer process per node, STRICT_SPREAD (ray_launch.spread)")
    p.add_argument("--rollout_engine", choices=("jax", "vllm"), default=None,
                   help="rollout actors' engine (train.rollout_engine; default: the gin config's, else jax)")
    p.add_argument("--transport", choices=("shm", "dist"), default=None,
                   help="weight sync to the rollout actors (ray_launch.transport, default shm)")
    p.add_argument("--cpus_per_actor", type=float, default=None,
                   help="CPUs of every bundle (ray_launch.cpus_per_actor, default 1)")
    p.add_argument("--gpus_per_actor", type=float, default=None,
                   help="GPUs of every bundle (ray_launch.gpus_per_actor; default: the cluster's GPUs split over "
                        "the trainer and the rollout actors; 0: CPU only)")
    p.add_argument("--num_cpus", type=int, default=None, help="CPUs of a local cluster (default: all)")
    p.add_argument("--ray_temp_dir", default=None, help="Ray session dir of a local cluster (short path)")
    return p


def main(argv=None) -> int:
    """Parse flags, start the Ray job, train, print the summary; returns the exit status."""
    args = build_parser().parse_args(argv)
    flags = {name: getattr(args, name) for name in FLAG_BINDINGS}
    if args.print_config:
        error = parse_gin_flags(args, flags)
        if error:
            return fail(error)
        print(bindable_config_text())
        return 0

    import gin

    cfg, error = config_from_gin_flags(args, flag_bindings=flags)
    if error:
        return fail(error)
    from fp8rl_jax.trainer.launch import RayLaunchConfig, describe_plan, launch_plan

    try:
        launch_cfg = RayLaunchConfig()
    except (ValueError, TypeError) as e:
        return fail(f"bad configuration: {error_line(e)}")
    error = missing_path_error(cfg)
    if error:
        return fail(error)
    kind, kwargs = launch_plan(cfg, launch_cfg)
    print(describe_plan(kind, kwargs), flush=True)
    from rollout_bridge import ray_launch

    init = {k: v for k, v in (("num_cpus", args.num_cpus), ("_temp_dir", args.ray_temp_dir)) if v is not None}
    try:
        if kind == "multihost":
            history = ray_launch.launch_multihost(cfg, address=args.address, ray_init_kwargs=init,
                                                  gin_config=gin.config_str(), **kwargs)
        else:
            history = ray_launch.launch(cfg, address=args.address, ray_init_kwargs=init, gin_config=gin.config_str(),
                                        **kwargs)
    except (ValueError, TimeoutError) as e:
        return fail(error_line(e))
    print(json.dumps({"steps": len(history), "reward/mean_last": history[-1]["reward/mean"] if history else None,
                      "timing/sync_s_mean": sum(m["timing/sync_s"] for m in history) / max(len(history), 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
