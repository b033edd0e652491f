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

from fp8rl_jax.trainer.cli import add_gin_flags, config_from_gin_flags, fail  # noqa: E402


def main(argv=None) -> int:
    """Parse the gin flags and train; returns the exit status (2 with a one-line message on bad input)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_gin_flags(parser)
    parser.add_argument("--resume", action="store_true",
                        help="continue from the latest checkpoint in OUTPUT_DIR/checkpoints (same as train.resume=True)")
    args = parser.parse_args(argv)
    cfg, error = config_from_gin_flags(args, **({"resume": True} if args.resume else {}))
    if error:
        return fail(error)
    from fp8rl_jax.trainer import train

    try:
        train(cfg)
    except FileNotFoundError as e:  # e.g. a checkpoint with missing files: one clear line, no traceback
        return fail(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
