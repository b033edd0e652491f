#!/usr/bin/env python
"""Launch GRPO on Ray: one trainer actor (JAX) + N rollout actors (vLLM or the embedded engine).

    # one machine (starts a local Ray cluster; token-auth secret kept under --ray_temp_dir)
    python scripts/launch_ray.py --gin_file=configs/quickstart.gin --num_rollout_actors=1 --output_dir=runs/ray

    # an existing cluster (run on the head node after `ray start --head`, workers `ray start --address=HEAD:6379`)
    python scripts/launch_ray.py --address=auto --gin_file=configs/quickstart.gin \\
        --rollout_engine=vllm --num_rollout_actors=4 --gpus_per_actor=1 --transport=dist --output_dir=runs/ray

    # multi-host training: one JAX process per node (jax.distributed, coordinator on the first node), each with a
    # colocated embedded rollout engine; the train step runs SPMD over a mesh spanning all of them
    python scripts/launch_ray.py --address=auto --num_trainer_processes=2 --spread --gpus_per_actor=8 \
        --gin_file=configs/paper/exp1_dense_w8a8.gin --gin_param='train.mesh="data=2,fsdp=8"' --output_dir=runs/mh

Weights go from the trainer to the rollout actors every step over ``--transport``: ``shm`` (shared-memory
buckets / CUDA IPC; all actors on one node) or ``dist`` (torch.distributed broadcast, gloo or NCCL; any nodes).
Gin bindings are those of scripts/train.py (``train.*``, ``LossConfig.*``, ``chain_sum_dataset.*``); they are
re-applied inside the trainer actor. Exit status 2 with a one-line message for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fp8rl_jax.trainer.cli import add_gin_flags, config_from_gin_flags, fail  # noqa: E402


def main(argv=None) -> int:
    """Parse flags, start the Ray job, train, print the summary; returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_gin_flags(p)
    p.add_argument("--address", default=None, help="existing Ray cluster ('auto', 'ray://head:10001'); "
                                                   "default: start a local one")
    p.add_argument("--num_rollout_actors", type=int, default=1)
    p.add_argument("--num_trainer_processes", type=int, default=1,
                   help="> 1: multi-host trainer, one JAX process per bundle with its own embedded rollout engine "
                        "(no rollout actors)")
    p.add_argument("--spread", action="store_true", help="multi-host: one trainer process per node (STRICT_SPREAD)")
    p.add_argument("--rollout_engine", choices=("jax", "vllm"), default="jax")
    p.add_argument("--transport", choices=("shm", "dist"), default="shm")
    p.add_argument("--cpus_per_actor", type=float, default=1)
    p.add_argument("--gpus_per_actor", type=float, default=0)
    p.add_argument("--num_cpus", type=int, default=None, help="CPUs of a local cluster (default: all)")
    p.add_argument("--ray_temp_dir", default=None, help="Ray session dir of a local cluster (short path)")
    args = p.parse_args(argv)

    import gin

    cfg, error = config_from_gin_flags(args)
    if error:
        return fail(error)
    from rollout_bridge.ray_launch import launch, launch_multihost

    init = {k: v for k, v in (("num_cpus", args.num_cpus), ("_temp_dir", args.ray_temp_dir)) if v is not None}
    try:
        if args.num_trainer_processes > 1:
            history = launch_multihost(cfg, num_processes=args.num_trainer_processes, address=args.address,
                                       cpus_per_process=args.cpus_per_actor, gpus_per_process=args.gpus_per_actor,
                                       spread=args.spread, ray_init_kwargs=init, gin_config=gin.config_str())
        else:
            history = launch(cfg, num_rollout_actors=args.num_rollout_actors, rollout_engine=args.rollout_engine,
                             transport=args.transport, address=args.address, cpus_per_actor=args.cpus_per_actor,
                             gpus_per_actor=args.gpus_per_actor, ray_init_kwargs=init, gin_config=gin.config_str())
    except (ValueError, TimeoutError) as e:
        return fail(str(e))
    print(json.dumps({"steps": len(history), "reward/mean_last": history[-1]["reward/mean"] if history else None,
                      "timing/sync_s_mean": sum(m["timing/sync_s"] for m in history) / max(len(history), 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
