"""Command-line plumbing shared by ``scripts/train.py`` and ``scripts/launch_ray.py``: gin flags -> TrainConfig."""

from __future__ import annotations

import argparse
import os
import sys


def add_gin_flags(parser: argparse.ArgumentParser) -> None:
    """Add ``--gin_file`` (repeatable), ``--gin_param`` (repeatable) and ``--output_dir`` to ``parser``."""
    parser.add_argument("--gin_file", action="append", default=[], help="gin config file (repeatable)")
    parser.add_argument("--gin_param", action="append", default=[], help="gin binding, e.g. train.num_steps=3")
    parser.add_argument("--output_dir", default=None, help="run directory (overrides train.output_dir)")


def config_from_gin_flags(args: argparse.Namespace, **overrides):
    """Parse the gin files/bindings in ``args`` and build the run's ``TrainConfig``.

    Args:
      args: parsed flags from a parser given :func:`add_gin_flags`.
      overrides: ``TrainConfig`` fields set on top of gin (``output_dir`` from the flag is added here).

    Returns:
      ``(config, None)`` on success, or ``(None, message)`` with a one-line error (missing gin file, a bad or
      misspelled binding, an invalid field value) for the script to print and exit with status 2.
    """
    import gin  # the configurables are registered: importing this module imported the fp8rl_jax.trainer package

    for path in args.gin_file:
        if not os.path.isfile(path):
            return None, f"gin file not found: {path}"
    try:
        gin.parse_config_files_and_bindings(args.gin_file, args.gin_param)
    except (ValueError, KeyError, SyntaxError, ImportError, TypeError) as e:
        return None, f"bad gin configuration: {str(e).splitlines()[0]}"
    from fp8rl_jax.trainer import TrainConfig

    if args.output_dir:
        overrides["output_dir"] = args.output_dir
    try:
        cfg = TrainConfig(**overrides)
    except (ValueError, TypeError) as e:
        return None, f"bad configuration: {str(e).splitlines()[0]}"  # gin appends "In call to ..." lines
    try:  # the loss settings are built by the trainer later: check their bindings now, before any work
        from fp8rl_jax.objectives import LossConfig
        from fp8rl_jax.trainer.validation import check_field_types

        check_field_types(LossConfig(), "LossConfig")
    except (ValueError, TypeError) as e:
        return None, f"bad configuration: {str(e).splitlines()[0]}"  # gin appends "In call to ..." lines
    return cfg, None


def error_line(e: BaseException) -> str:
    """An exception's message for a user: without the ``In call to configurable '...' (<function ... at 0x...>)``
    lines gin appends to errors raised inside configurables."""
    lines = [ln for ln in str(e).splitlines() if ln.strip() and not ln.strip().startswith("In call to configurable")]
    return " ".join(ln.strip() for ln in lines) or type(e).__name__


def fail(message: str) -> int:
    """Print ``error: message`` to stderr and return exit status 2."""
    print(f"error: {message}", file=sys.stderr)
    return 2
