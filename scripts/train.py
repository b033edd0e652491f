#!/usr/bin/env python
"""Main job: GRPO with FP8 rollout, configured by gin.

    python scripts/train.py --gin_file=configs/quickstart.gin --gin_param='train.num_steps=3' --output_dir=DIR
    python scripts/train.py ... --output_dir=DIR --resume      # continue from DIR/checkpoints (latest step)
    python scripts/train.py ... --output_dir=DIR --resume=auto # continue if DIR has a checkpoint, else start
    python scripts/train.py ... --output_dir=DIR --overwrite   # replace an earlier run in DIR
    python scripts/train.py ... --coordinator_address=HOST0:PORT --num_processes=2 --process_id=I   # one per host
    python scripts/train.py ... --compilation_cache_dir=DIR       # JAX's persistent compilation cache ('' = off)

A new run refuses an --output_dir that holds an earlier run's metrics or checkpoints (exit 2, one line naming
--resume and --overwrite), and --resume refuses a directory without a checkpoint, before any work.

Training precision is one gin line: ``train.train_precision = "bf16"`` | ``"fp16"`` | ``"fp8"`` (default
``"float32"``). Checkpoints: ``train.checkpoint_every`` / ``train.keep_checkpoints`` (orbax, async).

``--gin_file`` and ``--gin_param`` may repeat; bindings use the names of ``fp8rl_jax.trainer.TrainConfig``
(``train.*``), ``LossConfig.*`` / ``RolloutCorrectionConfig.*`` (policy loss and rollout correction), the datasets
(``chain_sum_dataset.*``, ``prompt_file_dataset.*``, ...), ``mesh.*``, ``distributed.*`` and ``ray_launch.*``;
``--print_config`` prints every bindable parameter of every namespace with its default (and what the given gin
files bind). A gin file's ``include 'configs/quickstart.gin'`` is looked up next to that file, then in the
repository root, so configs work from any working directory.
Exit status 2 with a one-line message for a bad gin file or binding, a bad run directory, or a model file that
cannot be loaded (set FP8RL_DEBUG=1 for the traceback); 130 on Ctrl-C, naming the checkpoint kept.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fp8rl_jax.trainer.cli import (  # noqa: E402
    add_gin_flags, bindable_config_text, config_from_gin_flags, error_line, fail, missing_path_error, parse_gin_flags)


def main(argv=None) -> int:
    """Parse the gin flags and train; returns the exit status (2 with a one-line message on bad input)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_gin_flags(parser)
    parser.add_argument("--resume", nargs="?", const="yes", choices=["yes", "auto"], default=None,
                        help="continue from the latest checkpoint in OUTPUT_DIR/checkpoints (train.resume=True); "
                             "--resume=auto: continue if there is one, else start a new run")
    parser.add_argument("--overwrite", action="store_true",
                        help="delete an earlier run's metrics, checkpoints and plots in OUTPUT_DIR and start anew")
    parser.add_argument("--coordinator_address", default=None,
                        help="multi-host: host:port of process 0 (jax.distributed; gin distributed.coordinator_address)")
    parser.add_argument("--num_processes", type=int, default=None, help="multi-host: processes in the job")
    parser.add_argument("--process_id", type=int, default=None, help="multi-host: this process's index")
    parser.add_argument("--compilation_cache_dir", default=None,
                        help="JAX's persistent compilation cache: compiled programs are loaded, not compiled, by the "
                             "next run. Default: $JAX_COMPILATION_CACHE_DIR if set, else $XDG_CACHE_HOME/fp8rl_jax/xla "
                             "(~/.cache/fp8rl_jax/xla) on a machine with an NVIDIA GPU, else off; '' turns it off "
                             "(fp8rl_jax/trainer/compile_cache.py)")
    args = parser.parse_args(argv)
    if args.print_config:
        error = parse_gin_flags(args)
        if error:
            return fail(error)
        print(bindable_config_text())
        return 0
    overrides = {}
    if args.resume:
        overrides["resume"] = True if args.resume == "yes" else "auto"
    if args.overwrite:
        overrides["overwrite"] = True
    cfg, error = config_from_gin_flags(args, **overrides)
    if error:
        return fail(error)
    error = missing_path_error(cfg)  # a model / prompt file path that is not here: name the binding to set
    if error:
        return fail(error)
    from fp8rl_jax.trainer import distributed
    from fp8rl_jax.trainer.compile_cache import enable_compilation_cache, resolve_cache_dir

    try:
        enable_compilation_cache(resolve_cache_dir(args.compilation_cache_dir))
    except OSError as e:
        return fail(str(e))

    try:  # before any JAX computation: join the other hosts' processes
        flags = {k: v for k, v in (("coordinator_address", args.coordinator_address),
                                   ("num_processes", args.num_processes), ("process_id", args.process_id))
                 if v is not None}
        distributed.initialize(distributed.DistributedConfig(**flags))
    except (ValueError, RuntimeError) as e:
        return fail(str(e).splitlines()[0])  # gin appends "In call to configurable ..." lines
    from fp8rl_jax.trainer import train

    try:
        train(cfg)
    except KeyboardInterrupt:
        code = interrupted(cfg.output_dir)
        sys.stdout.flush()
        sys.stderr.flush()
        # Leave now: orbax's background threads would log tracebacks during interpreter shutdown. A save that was
        # in flight stays an uncommitted temporary directory; orbax commits by rename, so the kept one is whole.
        os._exit(code)
    except (FileNotFoundError, ValueError) as e:  # bad run dir, model file, checkpoint: one clear line
        if os.environ.get("FP8RL_DEBUG"):
            raise
        from fp8rl_jax.trainer.validation import RunDirError

        user_error = isinstance(e, (RunDirError, FileNotFoundError))  # says what to do; a traceback adds nothing
        return fail(error_line(e) + ("" if user_error else " (FP8RL_DEBUG=1 shows the traceback)"))
    return 0


def interrupted(output_dir: str) -> int:
    """Ctrl-C: say which checkpoint is kept and how to continue (exit status 130, no traceback)."""
    from fp8rl_jax.trainer.validation import checkpoint_steps

    ckpt = os.path.join(output_dir, "checkpoints")
    steps = checkpoint_steps(output_dir)
    if steps:
        print(f"interrupted: checkpoint of step {steps[-1]} kept in {ckpt}/{steps[-1]}; continue with the same "
              "command plus --resume", file=sys.stderr)
    else:
        print(f"interrupted before the first checkpoint: nothing to resume in {output_dir} (rerun with "
              "--overwrite)", file=sys.stderr)
    return 130


if __name__ == "__main__":
    sys.exit(main())
