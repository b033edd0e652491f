#!/usr/bin/env python
"""Main job: GRPO with FP8 rollout, configured by gin.

    python scripts/train.py --gin_file=configs/quickstart.gin --gin_param='train.num_steps=3' --output_dir=DIR
    python scripts/train.py ... --output_dir=DIR --resume      # continue from DIR/checkpoints (latest step)

Training precision is one gin line: ``train.train_precision = "bf16"`` | ``"fp16"`` | ``"fp8"`` (default
``"float32"``). Checkpoints: ``train.checkpoint_every`` / ``train.keep_checkpoints`` (orbax, async).

``--gin_file`` and ``--gin_param`` may repeat; bindings use the names of ``fp8rl_jax.trainer.TrainConfig``
(``train.*``), ``LossConfig.*`` (policy loss and rollout correction) and ``chain_sum_dataset.*``.
Exit status 2 with a one-line message for a bad gin file or binding.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gin_file", action="append", default=[], help="gin config file (repeatable)")
    parser.add_argument("--gin_param", action="append", default=[], help="gin binding, e.g. train.num_steps=3")
    parser.add_argument("--output_dir", default=None, help="run directory (overrides train.output_dir)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the latest checkpoint in OUTPUT_DIR/checkpoints (same as train.resume=True)")
    args = parser.parse_args(argv)

    import gin

    import fp8rl_jax.trainer  # noqa: F401  (registers the gin configurables)

    for path in args.gin_file:
        if not os.path.isfile(path):
            print(f"error: gin file not found: {path}", file=sys.stderr)
            return 2
    try:
        gin.parse_config_files_and_bindings(args.gin_file, args.gin_param)
    except (ValueError, KeyError, SyntaxError, ImportError, TypeError) as e:
        print(f"error: bad gin configuration: {e}", file=sys.stderr)
        return 2
    from fp8rl_jax.trainer import TrainConfig, train

    try:
        kw = {"output_dir": args.output_dir} if args.output_dir else {}
        if args.resume:
            kw["resume"] = True
        cfg = TrainConfig(**kw)
    except (ValueError, TypeError) as e:
        print(f"error: bad configuration: {e}", file=sys.stderr)
        return 2
    try:
        train(cfg)
    except FileNotFoundError as e:  # e.g. a checkpoint with missing files: one clear line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
